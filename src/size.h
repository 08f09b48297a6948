/*
 * The one size grammar of every surface: the options table (SPILLWAY_CONF, spw_config_set), the
 * CLI's flags, the PyTorch allocator's budget list, the Python package (through spw_parse_size
 * and spw_parse_budget) and the interposer, which compiles this file into its own library.
 *
 * Grammar (docs/sizes.md), after leading and trailing blanks are dropped:
 *   SIZE    = NUMBER [blanks] [UNIT]       NUMBER = DIGITS ["." DIGITS]   (no sign, no exponent)
 *   PERCENT = NUMBER [blanks] "%"          0 < N <= 100, of the device (where the caller allows it)
 *   UNIT    = B | K | KB | KiB | M | MB | MiB | G | GB | GiB | T | TB | TiB   (any case)
 * Every unit is binary: K, KB and KiB all mean 2^10 bytes, G, GB and GiB all mean 2^30. A size
 * without a unit, or in B, is a whole number of bytes; with a larger unit a decimal is allowed and
 * the product is rounded down to a whole byte ("1.5GB" = 1610612736, "0.1K" = 102). A size is at
 * most SPW_SIZE_LIMIT bytes.
 *
 * Printing (spw__size_format): below 1 KiB "N B", else two decimals of the largest binary unit
 * up to TiB that keeps the number at least 1 ("1.50 GiB"). Printed text parses back (to the
 * bytes rounded to those two decimals).
 *
 * This file depends on the C library only (no spw__error: the interposer has none); callers
 * turn the message into their own error.
 */
#ifndef SPW_SIZE_H
#define SPW_SIZE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SPW_SIZE_LIMIT (((uint64_t)1 << 63) - 1)
/* Enough for every message of spw__size_parse on a text of up to 64 characters (longer texts
 * are quoted shortened). */
#define SPW_SIZE_ERR_MAX 256
/* Enough for spw__size_format. */
#define SPW_SIZE_FMT_MAX 24

/* A parsed size: bytes, or a percentage of something the caller knows (the device). */
typedef struct spw_size_spec {
    uint64_t bytes; /* when !is_percent */
    double percent; /* when is_percent: 0 < percent <= 100 (or above, with SPW_SIZE_PERCENT_ANY) */
    bool is_percent;
} spw_size_spec;

enum {
    SPW_SIZE_PERCENT = 1u << 0,     /* "N%" is accepted */
    SPW_SIZE_NONZERO = 1u << 1,     /* 0 bytes is an error (budgets) */
    SPW_SIZE_PERCENT_ANY = 1u << 2, /* with SPW_SIZE_PERCENT: no upper bound of 100 */
};

/* Parse text per the grammar above and flags. Returns 0 and fills *out, or -1 with *out
 * unchanged and a message in err (when err is not NULL) that quotes the text and says why. */
int spw__size_parse(const char *text, unsigned flags, spw_size_spec *out, char *err, size_t errlen);

/* A percentage of total, rounded down to a whole byte; a byte size as it is. */
uint64_t spw__size_resolve_spec(const spw_size_spec *s, uint64_t total);

/* The rule for a size rounded down to whole pages: say so, and warn when more than 1% of
 * what was asked for is lost. */
static inline bool spw__size_rounding_warns(uint64_t asked, uint64_t kept) {
    return kept < asked && (asked - kept) > asked / 100;
}

/* Print bytes as above into buf (SPW_SIZE_FMT_MAX is enough); returns buf. */
const char *spw__size_format(char *buf, size_t len, uint64_t bytes);

#endif
