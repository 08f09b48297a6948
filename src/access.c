/*
 * Access traces: synthetic buffer-access patterns for offload policies (tests/data/README.md).
 * One record a line, fields separated by blanks, '#' starts a comment (anywhere on a line):
 *
 *     b <id> <bytes> <ro|rw>           create a buffer (its data starts in host memory)
 *     s                                a step begins (the previous one ends)
 *     a <id>:<mode> [<id>:<mode> ...]  one operation: acquire all listed buffers together, then
 *                                      release them; mode r (read), w (overwrite all), rw
 *     f <id>                           destroy a buffer
 *
 * The loader is all or nothing and validates everything a consumer would otherwise have to check:
 * an id is live between its 'b' and its 'f' (a destroyed id may be created again: a new buffer),
 * bytes > 0, an 'a' names only live buffers, each at most once, and never writes a read-only one.
 * Buffers are numbered by their 'b' line (a recreated id gets a new number), so consumers index
 * arrays instead of hashing ids.
 *
 * Steps: every 's' starts a step. Accesses before the first 's' form an implicit first step, so
 * every access belongs to a step and per-step figures cover all of them.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "access.h"

/* uthash must never exit(): a failed insert sets `hash_oom`, a local at each HASH_ADD. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (hash_oom = 1)
#include <uthash.h>

typedef struct live_id {
    uint64_t id;
    uint32_t buf; /* index into bufs */
    UT_hash_handle hh;
} live_id;

typedef struct access_loader {
    const char *path;
    size_t line;
    spw_access_trace t;
    size_t cap_bufs, cap_ops, cap_items;
    live_id *live;   /* id -> buffer, for the buffers created and not yet destroyed */
    long step;       /* current step, -1 before the first */
    uint64_t live_bytes;
    uint32_t *seen;  /* per buffer: 1 + index of the last 'a' op listing it (duplicate check) */
    size_t cap_seen;
} access_loader;

/* SPW_ERR_PARSE with "PATH: line N: <what>". */
#define aparse_error(L, ...) spw__parse_error((L)->path, (L)->line, __VA_ARGS__)

static spw_status no_memory(const access_loader *L, const char *what) {
    return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "%s: line %zu: out of host memory for %s",
                      L->path, L->line, what);
}

static inline bool blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }
static inline bool field_end(char c) { return c == '\0' || c == '#' || blank(c); }

static const char *skip(const char *p) {
    while (blank(*p)) p++;
    return p;
}

/* The token at p (up to a blank or '#') copied into buf, for messages. */
static const char *tok(const char *p, char *buf, size_t len) {
    size_t n = 0;
    while (!field_end(p[n]) && n + 1 < len) n++;
    memcpy(buf, p, n);
    buf[n] = '\0';
    return buf;
}

/* Grow *arr (elements of `size`) so that index `need` fits. */
static bool grow(void **arr, size_t *cap, size_t need, size_t size) {
    if (need < *cap) return true;
    size_t n = *cap ? *cap : 64;
    while (n <= need) n *= 2;
    if (n > SIZE_MAX / size) return false;
    void *p = realloc(*arr, n * size);
    if (!p) return false;
    *arr = p;
    *cap = n;
    return true;
}

/* Unsigned decimal at *pp, digits only, ending at a blank, ':', '#' or the end of the line. */
static spw_status parse_num(access_loader *L, const char **pp, const char *name, uint64_t *out,
                            bool colon_ends) {
    const char *p = *pp;
    char t[48];
    if (*p < '0' || *p > '9')
        return aparse_error(L, "<%s> is not a number: '%s'", name, tok(p, t, sizeof t));
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 10);
    if (!field_end(*end) && !(colon_ends && *end == ':'))
        return aparse_error(L, "<%s> is not a number: '%s'", name, tok(p, t, sizeof t));
    if (errno == ERANGE)
        return aparse_error(L, "<%s> is out of range (more than 64 bits): '%s'", name,
                            tok(p, t, sizeof t));
    *out = (uint64_t)v;
    *pp = end;
    return SPW_OK;
}

static spw_status push_op(access_loader *L, const spw_access_op *op) {
    if (!grow((void **)&L->t.ops, &L->cap_ops, L->t.nops, sizeof *L->t.ops))
        return no_memory(L, "the op array");
    L->t.ops[L->t.nops++] = *op;
    return SPW_OK;
}

static live_id *find_live(access_loader *L, uint64_t id) {
    live_id *e = NULL;
    HASH_FIND(hh, L->live, &id, sizeof id, e);
    return e;
}

static spw_status parse_create(access_loader *L, const char *p) {
    uint64_t id, bytes;
    spw_status st;
    char t[48];
    if (field_end(*(p = skip(p)))) return aparse_error(L, "'b' needs <id> <bytes> <ro|rw>");
    if ((st = parse_num(L, &p, "id", &id, false))) return st;
    if (field_end(*(p = skip(p)))) return aparse_error(L, "'b %llu': missing <bytes>",
                                                       (unsigned long long)id);
    if ((st = parse_num(L, &p, "bytes", &bytes, false))) return st;
    if (bytes == 0) return aparse_error(L, "buffer %llu has bytes 0", (unsigned long long)id);
    p = skip(p);
    bool ro;
    if (!strncmp(p, "ro", 2) && field_end(p[2]))
        ro = true;
    else if (!strncmp(p, "rw", 2) && field_end(p[2]))
        ro = false;
    else if (field_end(*p))
        return aparse_error(L, "'b %llu': missing <ro|rw>", (unsigned long long)id);
    else
        return aparse_error(L, "'b %llu': bad kind '%s' (expected ro or rw)",
                            (unsigned long long)id, tok(p, t, sizeof t));
    p = skip(p + 2);
    if (!field_end(*p))
        return aparse_error(L, "trailing garbage after 'b': '%s'", tok(p, t, sizeof t));
    live_id *e = find_live(L, id);
    if (e)
        return aparse_error(L, "duplicate buffer id %llu (created on line %zu, not destroyed)",
                            (unsigned long long)id, L->t.bufs[e->buf].line);
    if (L->t.nbufs >= UINT32_MAX) return aparse_error(L, "too many buffers");
    if (!grow((void **)&L->t.bufs, &L->cap_bufs, L->t.nbufs, sizeof *L->t.bufs) ||
        !grow((void **)&L->seen, &L->cap_seen, L->t.nbufs, sizeof *L->seen))
        return no_memory(L, "the buffer array");
    if (!(e = malloc(sizeof *e))) return no_memory(L, "the id map");
    uint32_t idx = (uint32_t)L->t.nbufs;
    e->id = id;
    e->buf = idx;
    int hash_oom = 0;
    HASH_ADD(hh, L->live, id, sizeof e->id, e);
    if (hash_oom) {
        free(e);
        return no_memory(L, "the id map");
    }
    spw_access_op op = {.kind = 'b', .buf = idx, .step = L->step < 0 ? 0 : (size_t)L->step,
                        .line = L->line};
    if ((st = push_op(L, &op))) { /* undo the map entry: the loader state stays consistent */
        HASH_DEL(L->live, e);
        free(e);
        return st;
    }
    L->t.bufs[idx] = (spw_access_bufdef){.id = id, .bytes = bytes, .read_only = ro,
                                         .line = L->line};
    L->seen[idx] = 0;
    L->t.nbufs++;
    L->t.total_bytes += bytes;
    L->live_bytes += bytes;
    if (L->live_bytes > L->t.peak_live_bytes) L->t.peak_live_bytes = L->live_bytes;
    return SPW_OK;
}

static spw_status parse_access(access_loader *L, const char *p) {
    spw_status st;
    char t[48];
    if (L->step < 0) { /* accesses before the first 's': an implicit first step */
        L->step = 0;
        L->t.implicit_first_step = true;
    }
    spw_access_op op = {.kind = 'a', .first = L->t.nitems, .step = (size_t)L->step,
                        .line = L->line};
    uint32_t stamp = (uint32_t)(L->t.nops + 1);
    for (p = skip(p); !field_end(*p); p = skip(p)) {
        uint64_t id;
        if ((st = parse_num(L, &p, "id", &id, true))) return st;
        if (*p != ':')
            return aparse_error(L, "'%llu': missing ':<mode>' (r, w or rw)",
                                (unsigned long long)id);
        p++;
        spw_access mode;
        if (p[0] == 'r' && p[1] == 'w' && field_end(p[2])) {
            mode = SPW_ACCESS_READ_WRITE;
            p += 2;
        } else if (p[0] == 'r' && field_end(p[1])) {
            mode = SPW_ACCESS_READ;
            p += 1;
        } else if (p[0] == 'w' && field_end(p[1])) {
            mode = SPW_ACCESS_WRITE;
            p += 1;
        } else {
            return aparse_error(L, "buffer %llu: bad mode '%s' (expected r, w or rw)",
                                (unsigned long long)id, tok(p, t, sizeof t));
        }
        live_id *e = find_live(L, id);
        if (!e)
            return aparse_error(L, "access to unknown buffer id %llu (no live 'b' for it)",
                                (unsigned long long)id);
        const spw_access_bufdef *b = &L->t.bufs[e->buf];
        if (b->read_only && mode != SPW_ACCESS_READ)
            return aparse_error(L, "write (%s) to read-only buffer %llu (created 'ro' on line %zu)",
                                mode == SPW_ACCESS_WRITE ? "w" : "rw", (unsigned long long)id,
                                b->line);
        if (L->seen[e->buf] == stamp)
            return aparse_error(L, "buffer %llu listed twice in one operation",
                                (unsigned long long)id);
        L->seen[e->buf] = stamp;
        if (!grow((void **)&L->t.items, &L->cap_items, L->t.nitems, sizeof *L->t.items))
            return no_memory(L, "the access array");
        L->t.items[L->t.nitems++] = (spw_access_item){.buf = e->buf, .mode = mode};
        op.count++;
    }
    if (*p != '\0' && *p != '#' && !blank(*p))
        return aparse_error(L, "trailing garbage: '%s'", tok(p, t, sizeof t));
    if (op.count == 0) return aparse_error(L, "'a' lists no buffer (expected <id>:<mode> ...)");
    return push_op(L, &op);
}

static spw_status parse_line(access_loader *L, const char *line) {
    const char *p = skip(line);
    char t[48];
    if (*p == '\0' || *p == '#') return SPW_OK;
    char kind = *p;
    if (!strchr("bsaf", kind) || !field_end(p[1]))
        return aparse_error(L, "unknown record '%s' (expected b, s, a or f)", tok(p, t, sizeof t));
    p++;
    spw_status st;
    switch (kind) {
    case 'b':
        return parse_create(L, p);
    case 'a':
        return parse_access(L, p);
    case 's': {
        p = skip(p);
        if (!field_end(*p)) return aparse_error(L, "trailing garbage after 's': '%s'",
                                                tok(p, t, sizeof t));
        L->step++;
        spw_access_op op = {.kind = 's', .step = (size_t)L->step, .line = L->line};
        return push_op(L, &op);
    }
    default: { /* 'f' */
        uint64_t id;
        if (field_end(*(p = skip(p)))) return aparse_error(L, "'f' needs <id>");
        if ((st = parse_num(L, &p, "id", &id, false))) return st;
        p = skip(p);
        if (!field_end(*p)) return aparse_error(L, "trailing garbage after 'f %llu': '%s'",
                                                (unsigned long long)id, tok(p, t, sizeof t));
        live_id *e = find_live(L, id);
        if (!e) return aparse_error(L, "destroy of unknown buffer id %llu (not live)",
                                    (unsigned long long)id);
        spw_access_op op = {.kind = 'f', .buf = e->buf,
                            .step = L->step < 0 ? 0 : (size_t)L->step, .line = L->line};
        if ((st = push_op(L, &op))) return st;
        L->live_bytes -= L->t.bufs[e->buf].bytes;
        HASH_DEL(L->live, e);
        free(e);
        return SPW_OK;
    }
    }
}

static void loader_release(access_loader *L) {
    live_id *e, *tmp;
    HASH_ITER(hh, L->live, e, tmp) {
        HASH_DEL(L->live, e);
        free(e);
    }
    free(L->seen);
    L->seen = NULL;
}

spw_status spw__access_load(const char *path, spw_access_trace *out) {
    if (!path || !out)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw__access_load: %s is NULL",
                          !path ? "path" : "out");
    errno = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return spw__error(SPW_ERR_IO, "%s: cannot open access trace: %s", path,
                          errno ? strerror(errno) : "unknown error");
    access_loader L = {.path = path, .step = -1};
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    spw_status st = SPW_OK;
    errno = 0;
    while ((n = getline(&line, &cap, f)) >= 0) {
        L.line++;
        if (memchr(line, '\0', (size_t)n)) {
            st = aparse_error(&L, "NUL byte in line");
            break;
        }
        if ((st = parse_line(&L, line))) break;
        errno = 0;
    }
    if (st == SPW_OK && ferror(f))
        st = spw__error(SPW_ERR_IO, "%s: read error after line %zu: %s", path, L.line,
                        strerror(errno ? errno : EIO));
    free(line);
    fclose(f);
    loader_release(&L);
    if (st != SPW_OK) {
        spw__access_free(&L.t);
        return st;
    }
    L.t.nsteps = (size_t)(L.step + 1);
    *out = L.t;
    return SPW_OK;
}

void spw__access_free(spw_access_trace *t) {
    if (!t) return;
    free(t->bufs);
    free(t->ops);
    free(t->items);
    memset(t, 0, sizeof *t);
}

void spw__access_scale(spw_access_trace *t, uint64_t divisor) {
    if (!t || divisor <= 1) return;
    uint64_t total = 0, live = 0, peak = 0;
    for (size_t i = 0; i < t->nbufs; i++) {
        uint64_t b = t->bufs[i].bytes;
        t->bufs[i].bytes = b / divisor + (b % divisor != 0); /* round up: never 0 */
        total += t->bufs[i].bytes;
    }
    for (size_t i = 0; i < t->nops; i++) { /* recompute the peak of live bytes */
        if (t->ops[i].kind == 'b') live += t->bufs[t->ops[i].buf].bytes;
        if (t->ops[i].kind == 'f') live -= t->bufs[t->ops[i].buf].bytes;
        if (live > peak) peak = live;
    }
    t->total_bytes = total;
    t->peak_live_bytes = peak;
}
