/*
 * Allocation traces: load a whole trace (gzip or plain text, zlib reads both) into an array.
 *
 * Format (tests/data/README.md), one event a line, fields separated by blanks:
 *     a <id> <bytes> <stream>     allocate
 *     f <id>                      free the allocation <id>
 * Blank lines and lines whose first non-blank character is '#' are ignored; a '#' after the last
 * field starts a comment too. Numbers are unsigned decimal.
 *
 * The loader validates the pairing while it reads (ids are arbitrary 64-bit numbers, so through a
 * hash map): an 'a' must carry a new id and bytes > 0, an 'f' must name an allocation that is
 * live. A consumer can therefore replay a loaded trace without checking it again.
 *
 * For an 'f' op the loader also fills `bytes` and `stream` with those of its allocation, so a
 * consumer can account live bytes or pick the stream without a map of its own.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "trace.h"

/* uthash must never exit(): a failed insert sets `hash_oom`, a variable in scope at each
 * HASH_ADD, and the loader reports SPW_ERR_HOST_OUT_OF_MEMORY. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (hash_oom = 1)
#include <uthash.h>

#define TRACE_LINE_MAX 4096        /* longest accepted line, newline included */
#define TRACE_SLAB_ENTRIES 4096    /* map entries allocated together */

/* One allocation seen so far: its size and stream (for the 'f' op) and whether it was freed. */
typedef struct trace_entry {
    uint64_t id;
    uint64_t bytes;
    uint64_t stream;
    bool freed;
    UT_hash_handle hh;
} trace_entry;

/* Entries come from slabs so the map costs one malloc per TRACE_SLAB_ENTRIES allocations and is
 * freed in a few calls; entries never move (uthash keeps pointers to them). */
typedef struct trace_slab {
    struct trace_slab *next;
    size_t used;
    trace_entry entries[TRACE_SLAB_ENTRIES];
} trace_slab;

typedef struct trace_loader {
    const char *path;
    size_t line;               /* 1-based number of the line being parsed */
    spw_trace_op *ops;
    size_t count, cap;
    trace_entry *map;
    trace_slab *slabs;
} trace_loader;

static void loader_release(trace_loader *L) {
    HASH_CLEAR(hh, L->map);
    while (L->slabs) {
        trace_slab *next = L->slabs->next;
        free(L->slabs);
        L->slabs = next;
    }
    free(L->ops);
    L->ops = NULL;
    L->count = L->cap = 0;
}

/* SPW_ERR_PARSE with "PATH: line N: <what>". */
#define parse_error(L, ...) spw__parse_error((L)->path, (L)->line, __VA_ARGS__)

static inline bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static inline const char *skip_blanks(const char *p) {
    while (is_blank(*p)) p++;
    return p;
}

/* Copy the token at p (up to the next blank) into buf for an error message. */
static const char *token_text(const char *p, char *buf, size_t len) {
    size_t n = 0;
    while (p[n] && !is_blank(p[n]) && n + 1 < len) n++;
    memcpy(buf, p, n);
    buf[n] = '\0';
    return buf;
}

/* Parse the unsigned decimal field `name` at *pp (blanks before it are skipped) and advance *pp
 * past it. The field must be digits only and end at a blank, '#' or the end of the line;
 * strtoull alone would accept a sign, leading blanks and trailing letters. */
static spw_status parse_u64(trace_loader *L, const char **pp, const char *name, uint64_t *out) {
    const char *p = skip_blanks(*pp);
    char tok[40];
    if (*p == '\0' || *p == '#') return parse_error(L, "missing field <%s>", name);
    if (*p < '0' || *p > '9')
        return parse_error(L, "<%s> is not a number: '%s'", name, token_text(p, tok, sizeof tok));
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 10);
    if (*end != '\0' && *end != '#' && !is_blank(*end))
        return parse_error(L, "<%s> is not a number: '%s'", name, token_text(p, tok, sizeof tok));
    if (errno == ERANGE)
        return parse_error(L, "<%s> is out of range (more than 64 bits): '%s'", name,
                           token_text(p, tok, sizeof tok));
    *out = (uint64_t)v;
    *pp = end;
    return SPW_OK;
}

static spw_status push_op(trace_loader *L, const spw_trace_op *op) {
    if (L->count == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 1024;
        if (cap > SIZE_MAX / sizeof *L->ops)
            return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "%s: line %zu: too many ops (%zu)",
                              L->path, L->line, L->count);
        spw_trace_op *ops = realloc(L->ops, cap * sizeof *ops);
        if (!ops)
            return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                              "%s: line %zu: out of host memory growing the op array to %zu ops",
                              L->path, L->line, cap);
        L->ops = ops;
        L->cap = cap;
    }
    L->ops[L->count++] = *op;
    return SPW_OK;
}

static trace_entry *new_entry(trace_loader *L) {
    if (!L->slabs || L->slabs->used == TRACE_SLAB_ENTRIES) {
        trace_slab *s = malloc(sizeof *s);
        if (!s) return NULL;
        s->next = L->slabs;
        s->used = 0;
        L->slabs = s;
    }
    return &L->slabs->entries[L->slabs->used++];
}

/* Parse one line (NUL-terminated, newline possibly included) and append its op, if any. */
static spw_status parse_line(trace_loader *L, const char *line) {
    const char *p = skip_blanks(line);
    if (*p == '\0' || *p == '#') return SPW_OK;
    char tok[40];
    char kind = *p;
    if ((kind != 'a' && kind != 'f') || !(is_blank(p[1]) || p[1] == '\0'))
        return parse_error(L, "unknown op '%s' (expected 'a <id> <bytes> <stream>' or 'f <id>')",
                           token_text(p, tok, sizeof tok));
    p++;

    spw_trace_op op = {.kind = kind};
    spw_status st;
    if ((st = parse_u64(L, &p, "id", &op.id)) != SPW_OK) return st;
    if (kind == 'a') {
        if ((st = parse_u64(L, &p, "bytes", &op.bytes)) != SPW_OK) return st;
        if ((st = parse_u64(L, &p, "stream", &op.stream)) != SPW_OK) return st;
    }
    p = skip_blanks(p);
    if (*p != '\0' && *p != '#')
        return parse_error(L, "trailing garbage after the last field of '%c': '%s'", kind,
                           token_text(p, tok, sizeof tok));

    trace_entry *e = NULL;
    HASH_FIND(hh, L->map, &op.id, sizeof op.id, e);
    if (kind == 'a') {
        if (op.bytes == 0) return parse_error(L, "allocation %llu has bytes 0",
                                              (unsigned long long)op.id);
        if (e)
            return parse_error(L, "duplicate allocation id %llu (ids must be unique)",
                               (unsigned long long)op.id);
        e = new_entry(L);
        if (!e)
            return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                              "%s: line %zu: out of host memory for the id map", L->path, L->line);
        e->id = op.id;
        e->bytes = op.bytes;
        e->stream = op.stream;
        e->freed = false;
        int hash_oom = 0;
        HASH_ADD(hh, L->map, id, sizeof e->id, e);
        if (hash_oom)
            return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                              "%s: line %zu: out of host memory for the id map", L->path, L->line);
    } else {
        if (!e)
            return parse_error(L, "free of unknown id %llu (no earlier 'a')",
                               (unsigned long long)op.id);
        if (e->freed)
            return parse_error(L, "free of id %llu, which is already freed",
                               (unsigned long long)op.id);
        e->freed = true;
        op.bytes = e->bytes;
        op.stream = e->stream;
    }
    return push_op(L, &op);
}

/* Read every line of gz. Stops at the first malformed line or read error. */
static spw_status load_lines(trace_loader *L, gzFile gz) {
    char buf[TRACE_LINE_MAX];
    for (;;) {
        if (!gzgets(gz, buf, (int)sizeof buf)) break;
        L->line++;
        size_t len = strlen(buf);
        if (len == 0 || buf[len - 1] != '\n') {
            /* Only the last line may lack a newline; a truncated or corrupt gzip stream also
             * ends a line early, and must be reported as such, not as a short line. */
            int zerr = Z_OK;
            gzerror(gz, &zerr);
            if (zerr != Z_OK) break;
            if (len == sizeof buf - 1)
                return parse_error(L, "line longer than %d characters", TRACE_LINE_MAX - 2);
            if (len == 0 || !gzeof(gz)) return parse_error(L, "NUL byte in line");
        }
        spw_status st = parse_line(L, buf);
        if (st != SPW_OK) return st;
    }
    int zerr = Z_OK;
    const char *zmsg = gzerror(gz, &zerr);
    if (zerr == Z_ERRNO)
        return spw__error(SPW_ERR_IO, "%s: read error after line %zu: %s", L->path, L->line,
                          strerror(errno));
    if (zerr != Z_OK) {
        /* zlib's message starts with the path; it is already in ours. */
        size_t plen = strlen(L->path);
        if (!strncmp(zmsg, L->path, plen) && !strncmp(zmsg + plen, ": ", 2)) zmsg += plen + 2;
        return spw__error(SPW_ERR_PARSE, "%s: line %zu: corrupt or truncated gzip data: %s",
                          L->path, L->line, zmsg);
    }
    return SPW_OK;
}

spw_status spw__trace_load(const char *path, spw_trace *out) {
    if (!path || !out)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw__trace_load: %s is NULL",
                          !path ? "path" : "out");
    errno = 0;
    gzFile gz = gzopen(path, "rb");
    if (!gz)
        return spw__error(SPW_ERR_IO, "%s: cannot open trace: %s", path,
                          errno ? strerror(errno) : "out of memory");
    gzbuffer(gz, 256 * 1024);

    trace_loader L = {.path = path};
    spw_status st = load_lines(&L, gz);
    int cerr = gzclose(gz);
    if (st == SPW_OK && cerr != Z_OK && cerr != Z_BUF_ERROR)
        st = spw__error(SPW_ERR_IO, "%s: error closing trace (zlib %d)", path, cerr);
    if (st != SPW_OK) {
        loader_release(&L);
        return st;
    }
    /* The map is only needed while loading; the ops array is handed over. */
    out->ops = L.ops;
    out->count = L.count;
    L.ops = NULL;
    loader_release(&L);
    return SPW_OK;
}

void spw__trace_free(spw_trace *t) {
    if (!t) return;
    free(t->ops);
    t->ops = NULL;
    t->count = 0;
}
