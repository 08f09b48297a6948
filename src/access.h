/*
 * Access traces for offload policies (access.c, whose opening comment gives the format;
 * spillway_tools: the CLI and the tests).
 */
#ifndef SPW_ACCESS_H
#define SPW_ACCESS_H

#include "internal.h"

typedef struct spw_access_bufdef {
    uint64_t id;          /* the trace's id (reused ids give distinct buffers) */
    uint64_t bytes;       /* > 0 */
    bool read_only;       /* 'ro': no access writes it */
    size_t line;          /* line of its 'b' */
} spw_access_bufdef;

typedef struct spw_access_item {
    uint32_t buf;         /* index into bufs */
    spw_access mode;      /* SPW_ACCESS_READ (r), _WRITE (w), _READ_WRITE (rw) */
} spw_access_item;

typedef struct spw_access_op {
    char kind;            /* 'b' create, 's' step, 'a' access, 'f' destroy */
    uint32_t buf;         /* 'b', 'f': index into bufs */
    size_t first, count;  /* 'a': items[first .. first+count) (count >= 1, distinct buffers) */
    size_t step;          /* step this op belongs to (0-based; 's' carries the step it begins) */
    size_t line;          /* source line, for messages */
} spw_access_op;

typedef struct spw_access_trace {
    spw_access_bufdef *bufs;
    size_t nbufs;
    spw_access_op *ops;
    size_t nops;
    spw_access_item *items;
    size_t nitems;
    size_t nsteps;            /* 's' lines, plus one if accesses come before the first 's' */
    bool implicit_first_step; /* accesses before the first 's' form step 0 */
    uint64_t total_bytes;     /* sum of the bytes of every 'b' */
    uint64_t peak_live_bytes; /* peak of the bytes of buffers created and not destroyed */
} spw_access_trace;

/* Load a whole access trace; all or nothing. SPW_ERR_IO when it cannot be read, SPW_ERR_PARSE
 * naming file, line and problem for malformed input. The result is fully validated. */
spw_status spw__access_load(const char *path, spw_access_trace *out);
void spw__access_free(spw_access_trace *t);
/* Divide every buffer size by `divisor` (rounded up, so never 0) and recompute the totals. */
void spw__access_scale(spw_access_trace *t, uint64_t divisor);

#endif /* SPW_ACCESS_H */
