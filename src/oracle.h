/*
 * Offline models of the bytes a policy moves, yardsticks for the engine (oracle.c;
 * spillway_tools: the CLI and the tests).
 */
#ifndef SPW_ORACLE_H
#define SPW_ORACLE_H

#include "access.h"

typedef enum spw_model_kind {
    SPW_MODEL_ORACLE, /* Belady: evict the farthest next use; write back only if next use reads */
    SPW_MODEL_ORACLE_REPEAT, /* the oracle, with the last step assumed to run once more after
                              * the end (no end-of-trace drops of dirty data): see oracle.c */
    SPW_MODEL_LRU,    /* evict the least recently used; write back every dirty buffer */
} spw_model_kind;

typedef struct spw_model_result {
    size_t nsteps;
    uint64_t *h2d, *d2h;         /* per step, nsteps entries each */
    uint64_t bytes_h2d, bytes_d2h;
    uint64_t evictions_clean;    /* evictions that copied nothing back */
    uint64_t evictions_dirty;    /* evictions that wrote the buffer back to the host */
} spw_model_result;

/* Run the trace through the model with `budget` device bytes. Buffers start in host memory.
 * SPW_ERR_OUT_OF_MEMORY (naming the line) when one operation's buffers exceed the budget. */
spw_status spw__model_run(const spw_access_trace *t, uint64_t budget, spw_model_kind kind,
                          spw_model_result *out);
void spw__model_free(spw_model_result *r);
/* Sum of h2d + d2h over steps [from, nsteps). */
uint64_t spw__model_moved_from(const spw_model_result *r, size_t from);

#endif /* SPW_ORACLE_H */
