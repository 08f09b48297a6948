/* The size grammar and the size printer; see size.h for the contracts. */
#include "size.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#define UNITS_TEXT "B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB"

/* Exact products of up to 18 decimal digits and 2^40 need more than 64 bits. */
__extension__ typedef unsigned __int128 u128;

static bool blank(char c) { return c == ' ' || c == '\t'; }

static int fail(char *err, size_t errlen, const char *text, size_t tlen, const char *why) {
    if (err && errlen) {
        if (tlen > 64) snprintf(err, errlen, "bad size '%.60s...': %s", text, why);
        else snprintf(err, errlen, "bad size '%.*s': %s", (int)tlen, text, why);
    }
    return -1;
}

int spw__size_parse(const char *text, unsigned flags, spw_size_spec *out, char *err, size_t errlen) {
    static const struct {
        const char *name;
        unsigned shift;
    } units[] = {{"B", 0},    {"K", 10},  {"KB", 10},  {"KiB", 10}, {"M", 20},  {"MB", 20}, {"MiB", 20},
                 {"G", 30},   {"GB", 30}, {"GiB", 30}, {"T", 40},   {"TB", 40}, {"TiB", 40}};
    if (!text) text = "";
    const char *p = text, *q = text + strlen(text);
    while (blank(*p)) p++;
    while (q > p && blank(q[-1])) q--;
    const char *t = p; /* the trimmed text, quoted in messages */
    size_t tlen = (size_t)(q - p);
    char why[160];
    const bool pct_ok = flags & SPW_SIZE_PERCENT;
    if (!tlen) return fail(err, errlen, t, tlen, "empty (expected a number with an optional unit)");

    /* NUMBER: the whole part exactly, the fraction as an integer of its first 18 digits */
    uint64_t whole = 0, frac = 0, frac_div = 1;
    bool overflow = false, frac_lost = false;
    const char *d0 = p;
    while (p < q && isdigit((unsigned char)*p)) {
        unsigned d = (unsigned)(*p++ - '0');
        if (whole > (UINT64_MAX - d) / 10) overflow = true;
        else whole = whole * 10 + d;
    }
    bool have_digits = p > d0;
    if (have_digits && p < q && *p == '.') {
        const char *f0 = ++p;
        while (p < q && isdigit((unsigned char)*p)) {
            unsigned d = (unsigned)(*p++ - '0');
            if (frac_div <= UINT64_MAX / 100) {
                frac = frac * 10 + d;
                frac_div *= 10;
            } else if (d) {
                frac_lost = true; /* later digits weigh at most about a millionth of a byte at 2^40 */
            }
        }
        if (p == f0) return fail(err, errlen, t, tlen, "expected digits after the decimal point");
    }
    if (!have_digits) {
        snprintf(why, sizeof why, "expected a number (digits, optionally a decimal point) with an optional unit (%s)%s",
                 UNITS_TEXT, pct_ok ? ", or N%" : "");
        return fail(err, errlen, t, tlen, why);
    }
    while (p < q && blank(*p)) p++;
    size_t ulen = (size_t)(q - p);

    if (ulen == 1 && *p == '%') {
        if (!pct_ok) return fail(err, errlen, t, tlen, "a percentage is not accepted here (give a size)");
        double pct = (double)whole + (double)frac / (double)frac_div;
        if (overflow || !(pct > 0.0) || (!(flags & SPW_SIZE_PERCENT_ANY) && pct > 100.0))
            return fail(err, errlen, t, tlen,
                        flags & SPW_SIZE_PERCENT_ANY ? "a percentage must be greater than 0"
                                                     : "a percentage must be greater than 0 and at most 100");
        *out = (spw_size_spec){.percent = pct, .is_percent = true};
        return 0;
    }
    unsigned shift = 0;
    bool found = ulen == 0;
    for (size_t i = 0; !found && i < sizeof units / sizeof units[0]; i++) {
        if (strlen(units[i].name) == ulen && !strncasecmp(p, units[i].name, ulen)) {
            shift = units[i].shift;
            found = true;
        }
    }
    if (!found) {
        if (memchr(p, '%', ulen))
            return fail(err, errlen, t, tlen, "nothing may follow or stand between a number and '%'");
        snprintf(why, sizeof why, "unknown unit '%.*s' (units: %s; all binary, any case)", (int)(ulen < 32 ? ulen : 32), p,
                 UNITS_TEXT);
        return fail(err, errlen, t, tlen, why);
    }
    if (shift == 0 && (frac || frac_lost))
        return fail(err, errlen, t, tlen, "a number of bytes must be whole (use a larger unit for a decimal)");
    if (overflow || whole > (SPW_SIZE_LIMIT >> shift)) goto too_large;
    u128 bytes = ((u128)whole << shift) + (((u128)frac << shift) / frac_div);
    if (bytes > SPW_SIZE_LIMIT) goto too_large;
    if (bytes == 0 && (flags & SPW_SIZE_NONZERO)) return fail(err, errlen, t, tlen, "must be at least 1 byte");
    *out = (spw_size_spec){.bytes = (uint64_t)bytes};
    return 0;
too_large:
    return fail(err, errlen, t, tlen, "too large (at most 2^63 - 1 bytes, 8 EiB)");
}

uint64_t spw__size_resolve_spec(const spw_size_spec *s, uint64_t total) {
    if (!s->is_percent) return s->bytes;
    return (uint64_t)((double)total * s->percent / 100.0);
}

const char *spw__size_format(char *buf, size_t len, uint64_t bytes) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    else snprintf(buf, len, "%.2f %s", v, units[u]);
    return buf;
}
