/*
 * Allocation traces, gzip or text (trace.c; spillway_tools: the CLI and the tests).
 */
#ifndef SPW_TRACE_H
#define SPW_TRACE_H

#include "internal.h"

typedef struct spw_trace_op {
    char kind;            /* 'a' or 'f' */
    uint64_t id;
    uint64_t bytes;       /* for 'f': those of its allocation (filled by the loader) */
    uint64_t stream;      /* likewise */
} spw_trace_op;

typedef struct spw_trace {
    spw_trace_op *ops;
    size_t count;
} spw_trace;

/* Load a whole trace; SPW_ERR_PARSE names the line on malformed input. */
spw_status spw__trace_load(const char *path, spw_trace *out);
void spw__trace_free(spw_trace *t);

#endif /* SPW_TRACE_H */
