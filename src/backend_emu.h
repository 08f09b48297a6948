/*
 * backend_emu.h: private to the emulated device (backend_emu.c, emu_stream.c). Not a public or
 * library-wide header: the rest of spillway reaches the emu through backend.h / internal.h.
 *
 * Holds the emu's state (emu_backend and the records it owns), the call-counting/fault entry
 * check every vtable function starts with (ENTER), and the functions one half calls in the
 * other:
 * - backend_emu.c: the backend (vtable, create/destroy, fault injection), memory, VMM, host
 *   and managed allocation. Defines spw__emu_enter and spw__emu_find_range.
 * - emu_stream.c: streams (one worker thread each), work queues, copies, host launches,
 *   prefetch, events. Defines the stream/event vtable functions and spw__emu_stream_start/stop.
 * Locks: mem_lock guards memory bookkeeping, q_lock guards streams, events and queues; no
 * function holds both. Host callbacks run on workers without any lock held.
 */
#ifndef SPW_BACKEND_EMU_H
#define SPW_BACKEND_EMU_H

#include <pthread.h>
#include <stdatomic.h>

#include "backend.h"
#include "internal.h"

/* uthash must not exit on allocation failure: functions that add declare `int hash_oom_ = 0`. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (hash_oom_ = 1)
#include <uthash.h>

#define EMU_PERSIST ((uint64_t)1 << 63)

typedef struct emu_alloc { /* from dev_alloc, managed_alloc, host_alloc, host_register */
    void *ptr;             /* key */
    size_t bytes;          /* as requested */
    size_t map_bytes;      /* length of the mapping (0 for registrations) */
    unsigned advice;       /* managed: bit per spw_managed_advice last applied */
    UT_hash_handle hh;
} emu_alloc;

typedef struct emu_resv {
    struct emu_resv *next;
    char *va;
    size_t bytes;
    size_t page;    /* map/unmap unit: the granularity or a power-of-two multiple */
    size_t mapped;  /* pages mapped */
    uint64_t *bits; /* one bit per page */
} emu_resv;

typedef enum { W_COPY, W_HOST, W_WAIT, W_PREFETCH } emu_work;

typedef struct emu_item {
    struct emu_item *next;
    emu_work kind;
    uint64_t seq;
    union {
        struct { void *dst; const void *src; size_t bytes; int timed; } copy;
        struct { void (*fn)(void *); void *arg; } host;
        struct { struct emu_stream *s; uint64_t seq; } wait;
        size_t prefetch_bytes;
    } u;
} emu_item;

typedef struct emu_stream {
    void *key; /* self: the handle */
    struct emu_backend *b;
    struct emu_stream *next_all;  /* every stream struct, kept until the backend goes */
    struct emu_stream *next_dead; /* destroyed, ready for reuse */
    pthread_t thread;
    pthread_cond_t cv_work; /* the worker sleeps here while its queue is empty */
    emu_item *head, *tail;
    uint64_t enq_seq;  /* sequence number of the last item enqueued */
    uint64_t done_seq; /* sequence number of the last item finished */
    uint64_t link_ns;  /* worker only: when the link's last timed transfer on this stream ended */
    int stop;
    UT_hash_handle hh;
} emu_stream;

typedef struct emu_event {
    void *key;       /* self */
    emu_stream *rec; /* NULL: never recorded */
    uint64_t rec_seq;
    UT_hash_handle hh;
} emu_event;

typedef struct emu_backend {
    spw_backend base; /* first: a spw_backend * is an emu_backend * */
    spw_backend_ops ops;
    size_t capacity, gran, page;
    /* page-locked host bytes (host_alloc and host_register) and their limit (0: none); mem_lock */
    size_t pin_limit, pinned_host;
    int vmm, managed;
    double gbps;
    _Atomic uint64_t calls[SPW_CALL_COUNT_];
    _Atomic uint64_t faults[SPW_CALL_COUNT_]; /* 0, or call number to fail | EMU_PERSIST */

    pthread_mutex_t mem_lock;
    size_t used;
    emu_alloc *devs, *manageds, *hosts, *regs;
    emu_resv *resvs;

    pthread_mutex_t q_lock;
    pthread_cond_t cv_done; /* broadcast when an item finishes while someone waits */
    unsigned done_waiters;
    emu_stream *def;  /* the default stream */
    emu_stream *live; /* hash of user-created streams */
    emu_stream *all, *dead;
    emu_event *events;
    emu_item *free_items;
} emu_backend;

#define EMU(b) ((emu_backend *)(b))

/* Count the call; fail it (before any side effect) when a fault is armed for its number. */
spw_status spw__emu_enter(emu_backend *e, spw_call c);

#define ENTER(e, call)                                                                         \
    do {                                                                                       \
        spw_status st_ = spw__emu_enter((e), SPW_CALL_##call);                                 \
        if (st_ != SPW_OK) return st_;                                                         \
    } while (0)

/* ---- backend_emu.c ---- */

/* The entry of `table` that contains [p, p+bytes) (inside=1) or overlaps it (inside=0), or
 * NULL. mem_lock held. */
emu_alloc *spw__emu_find_range(emu_alloc *table, const void *p, size_t bytes, int inside);

/* ---- emu_stream.c ---- */

/* A stream struct with a running worker: a recycled one or a new one. Called without q_lock. */
spw_status spw__emu_stream_start(emu_backend *e, emu_stream **out);
/* Drain s, stop its worker, join it and park the struct for reuse. q_lock held (released
 * while joining). */
void spw__emu_stream_stop(emu_backend *e, emu_stream *s);

/* The stream and event ops of the vtable (contracts in backend.h). */
spw_status spw__emu_stream_create(spw_backend *b, spw_stream *out);
spw_status spw__emu_stream_destroy(spw_backend *b, spw_stream h);
spw_status spw__emu_stream_sync(spw_backend *b, spw_stream h);
spw_status spw__emu_memcpy_async(spw_backend *b, void *dst, const void *src, size_t bytes,
                                 spw_copy_kind kind, spw_stream h);
spw_status spw__emu_launch_host(spw_backend *b, spw_stream h, void (*fn)(void *), void *arg);
spw_status spw__emu_prefetch(spw_backend *b, void *ptr, size_t bytes, int to_device,
                             spw_stream h);
spw_status spw__emu_event_create(spw_backend *b, spw_event *out);
spw_status spw__emu_event_destroy(spw_backend *b, spw_event h);
spw_status spw__emu_event_record(spw_backend *b, spw_event h, spw_stream sh);
spw_status spw__emu_event_query(spw_backend *b, spw_event h);
spw_status spw__emu_event_sync(spw_backend *b, spw_event h);
spw_status spw__emu_stream_wait(spw_backend *b, spw_stream sh, spw_event h);

#endif
