/*
 * The pinned host pool (hostmem.c): host copies of buffers, sub-allocated from large pinned
 * slabs under a host budget. It knows its backend and the counter it is handed, nothing above.
 * Called with the owner's lock held (the context's).
 */
#ifndef SPW_HOSTMEM_H
#define SPW_HOSTMEM_H

#include "backend.h"
#include "internal.h"

typedef struct spw_hostpool spw_hostpool;
typedef struct spw_hblock spw_hblock;

/* A pool over backend `be` holding at most `budget` bytes; the bytes it holds are counted in
 * *held (the owner's counter, guarded by the owner's lock). */
spw_status spw__hostpool_create(spw_backend *be, spw_counter *held, size_t budget, spw_hostpool **out);
void spw__hostpool_destroy(spw_hostpool *hp);
/* `bytes` of pinned host memory from a slab; SPW_ERR_HOST_OUT_OF_MEMORY names the numbers. */
spw_status spw__hostpool_alloc(spw_hostpool *hp, size_t bytes, void **ptr, spw_hblock **blk);
void spw__hostpool_free(spw_hostpool *hp, spw_hblock *blk);
/* Return slabs with nothing allocated in them to the backend. */
void spw__hostpool_trim(spw_hostpool *hp);
size_t spw__hostpool_budget(const spw_hostpool *hp);

#endif /* SPW_HOSTMEM_H */
