/*
 * What every file of the library shares: size and arithmetic macros, error reporting (error.c)
 * and the clock. Each module declares the rest in its own header (options.h, backend.h,
 * arena.h, hostmem.h, ctx.h, stats.h, engine.h, policy.h, and for the tools trace.h, access.h,
 * oracle.h).
 * Nothing here is public API; tests link the static library and may use these.
 */
#ifndef SPW_INTERNAL_H
#define SPW_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "size.h"
#include "spillway.h"

#define SPW_KiB ((size_t)1 << 10)
#define SPW_MiB ((size_t)1 << 20)
#define SPW_GiB ((size_t)1 << 30)
#define SPW_TiB ((size_t)1 << 40)

#define SPW_MIN(a, b) ((a) < (b) ? (a) : (b))
#define SPW_MAX(a, b) ((a) > (b) ? (a) : (b))
#define SPW_ALIGN_UP(x, a) (((x) + ((a)-1)) / (a) * (a))
#define SPW_ALIGN_DOWN(x, a) ((x) / (a) * (a))

#if defined(__GNUC__)
#define SPW_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define SPW_LIKELY(x) __builtin_expect(!!(x), 1)
#define SPW_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define SPW_PRINTF(f, a)
#define SPW_LIKELY(x) (x)
#define SPW_UNLIKELY(x) (x)
#endif

/* ---- error.c ---- */

/* Set the calling thread's message and return status (so callers write `return spw__error(...)`). */
spw_status spw__error(spw_status status, const char *fmt, ...) SPW_PRINTF(2, 3);
spw_status spw__verror(spw_status status, const char *fmt, va_list ap);
/* Prefix the current thread's message with "what: " (keeps the status). */
spw_status spw__error_prefix(spw_status status, const char *fmt, ...) SPW_PRINTF(2, 3);
void spw__error_clear(void);
/* SPW_ERR_PARSE with "PATH: line N: <what>" (trace and configuration file loaders). */
spw_status spw__parse_error(const char *path, size_t line, const char *fmt, ...) SPW_PRINTF(3, 4);
/* Format bytes as "1.50 GiB (1610612736 B)" into buf. */
const char *spw__fmt_bytes(char *buf, size_t len, uint64_t bytes);

/* Monotonic clock, in nanoseconds. */
static inline uint64_t spw__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif /* SPW_INTERNAL_H */
