/* The size grammar (size.c) as the library's API and errors: SPW_ERR_CONFIG with size.c's message. */
#include "internal.h"
#include "options.h"

static spw_status parse(const char *text, unsigned flags, spw_size_spec *out) {
    char err[SPW_SIZE_ERR_MAX];
    if (spw__size_parse(text, flags, out, err, sizeof err)) return spw__error(SPW_ERR_CONFIG, "%s", err);
    return SPW_OK;
}

SPW_API spw_status spw_parse_size(const char *text, size_t *out) {
    if (!text || !out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_parse_size: NULL argument");
    spw_size_spec s;
    spw_status st = parse(text, 0, &s);
    if (!st) *out = (size_t)s.bytes;
    return st;
}

SPW_API spw_status spw_parse_budget(const char *text, uint64_t device_total, uint64_t *bytes, double *percent) {
    if (!text) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_parse_budget: text is NULL");
    spw_size_spec s;
    spw_status st = parse(text, SPW_SIZE_PERCENT | SPW_SIZE_NONZERO, &s);
    if (st) return st;
    if (bytes) *bytes = spw__size_resolve_spec(&s, device_total);
    if (percent) *percent = s.is_percent ? s.percent : 0.0;
    return SPW_OK;
}

SPW_API const char *spw_format_size(uint64_t bytes, char *buf, size_t len) {
    if (!buf || !len) return "";
    return spw__size_format(buf, len, bytes);
}

spw_status spw__parse_size_opt(const char *text, spw_size_opt *out) {
    if (!text || !out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "size: NULL argument");
    return parse(text, SPW_SIZE_PERCENT, out);
}

size_t spw__size_resolve(const spw_size_opt *o, size_t device_total) {
    return (size_t)spw__size_resolve_spec(o, device_total);
}
