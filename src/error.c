/* Status names and the thread-local error message. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local char tls_msg[1024];

static const char *const status_names[SPW_STATUS_COUNT_] = {
    [SPW_OK] = "SPW_OK",
    [SPW_ERR_INVALID_ARGUMENT] = "SPW_ERR_INVALID_ARGUMENT",
    [SPW_ERR_OUT_OF_MEMORY] = "SPW_ERR_OUT_OF_MEMORY",
    [SPW_ERR_HOST_OUT_OF_MEMORY] = "SPW_ERR_HOST_OUT_OF_MEMORY",
    [SPW_ERR_CONFIG] = "SPW_ERR_CONFIG",
    [SPW_ERR_BACKEND] = "SPW_ERR_BACKEND",
    [SPW_ERR_UNSUPPORTED] = "SPW_ERR_UNSUPPORTED",
    [SPW_ERR_NOT_FOUND] = "SPW_ERR_NOT_FOUND",
    [SPW_ERR_STATE] = "SPW_ERR_STATE",
    [SPW_ERR_NOT_READY] = "SPW_ERR_NOT_READY",
    [SPW_ERR_IO] = "SPW_ERR_IO",
    [SPW_ERR_PARSE] = "SPW_ERR_PARSE",
    [SPW_ERR_NO_DEVICE] = "SPW_ERR_NO_DEVICE",
};

SPW_API const char *spw_status_str(spw_status status) {
    if ((unsigned)status >= SPW_STATUS_COUNT_) return "SPW_ERR_UNKNOWN";
    return status_names[status];
}

SPW_API const char *spw_last_error(void) { return tls_msg; }

SPW_API const char *spw_version(void) { return SPW_VERSION_STRING; }

spw_status spw__verror(spw_status status, const char *fmt, va_list ap) {
    vsnprintf(tls_msg, sizeof tls_msg, fmt, ap);
    return status;
}

spw_status spw__error(spw_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    spw__verror(status, fmt, ap);
    va_end(ap);
    return status;
}

spw_status spw__error_prefix(spw_status status, const char *fmt, ...) {
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    size_t plen = strlen(prefix), mlen = strlen(tls_msg);
    if (plen + 2 >= sizeof tls_msg) plen = sizeof tls_msg - 3;
    if (plen + 2 + mlen >= sizeof tls_msg) mlen = sizeof tls_msg - 3 - plen;
    memmove(tls_msg + plen + 2, tls_msg, mlen);
    memcpy(tls_msg, prefix, plen);
    tls_msg[plen] = ':';
    tls_msg[plen + 1] = ' ';
    tls_msg[plen + 2 + mlen] = '\0';
    return status;
}

spw_status spw__parse_error(const char *path, size_t line, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return spw__error(SPW_ERR_PARSE, "%s: line %zu: %s", path, line, what);
}

void spw__error_clear(void) { tls_msg[0] = '\0'; }

const char *spw__fmt_bytes(char *buf, size_t len, uint64_t bytes) {
    char h[SPW_SIZE_FMT_MAX];
    spw__size_format(h, sizeof h, bytes);
    if (bytes < 1024) snprintf(buf, len, "%s", h);
    else snprintf(buf, len, "%s (%llu B)", h, (unsigned long long)bytes);
    return buf;
}
