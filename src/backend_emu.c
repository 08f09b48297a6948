/*
 * emu: a device emulated in host memory, for machines without a GPU and for deterministic tests.
 *
 * Model (beyond the contracts in backend.h):
 * - Device memory is anonymous host memory mapped MAP_NORESERVE, so untouched device bytes cost
 *   no RAM. "used" (dev_alloc + mapped granules + managed) never exceeds the capacity; managed
 *   memory is charged in full at allocation, as if always resident on the device. Charges are
 *   the requested bytes, unrounded.
 * - VMM: va_reserve maps PROT_NONE address space aligned to the granularity; map makes granules
 *   read/write and charges them; unmap may release ANY granule-aligned subrange of mapped memory
 *   (more permissive than cuMemUnmap, which wants whole earlier maps). A bitmap per reservation
 *   makes double maps and unmaps of unmapped memory SPW_ERR_STATE. va_release of a reservation
 *   that still has mapped granules is SPW_ERR_STATE and changes nothing.
 * - Streams: one worker thread per stream (the default stream NULL included, created with the
 *   backend) runs enqueued items in FIFO order. The default stream is an ordinary ordered
 *   stream: it has no legacy implicit synchronization with other streams.
 * - Events are positions, not flags: record captures (stream, sequence number of the last item
 *   enqueued on it); the event is complete once that stream has finished that item. A wait
 *   captures the position current at the wait, so re-recording (or destroying) the event later
 *   does not affect it. A never-recorded event is complete. Stream structs are never freed
 *   before the backend (destroyed ones are recycled and their sequence numbers keep counting
 *   up), so a captured position stays readable, and complete once its stream was destroyed.
 * - Every vtable function counts its call kind and checks for an injected fault before anything
 *   else; a fault has no side effect. device_info counts as mem_info, managed_free as dev_free
 *   (cudaFree frees managed memory too).
 * - free(NULL) (dev_free, host_free, managed_free) succeeds and does nothing, like cudaFree.
 * - Params: a 0 field means the default (80 GiB, 2 MiB, vmm on, managed on); emu_vmm < 0 or
 *   emu_managed < 0 turns the feature off. Without vmm the va_* and map/unmap ops are NULL;
 *   without managed, prefetch is SPW_ERR_UNSUPPORTED (as on a device without concurrent
 *   managed access). emu_h2d_gbps > 0 makes H2D/D2H copies and prefetches take bytes/rate.
 * Locks: mem_lock guards memory bookkeeping, q_lock guards streams, events and queues; no
 * function holds both. Host callbacks run on workers without any lock held.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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
    size_t mapped;  /* granules mapped */
    uint64_t *bits; /* one bit per granule */
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

static void emu_destroy(spw_backend *b);
#define EMU(b) ((emu_backend *)(b))

/* ---- call counting and fault injection ---- */

/* Count the call; fail it (before any side effect) when a fault is armed for its number. */
static spw_status enter(emu_backend *e, spw_call c) {
    uint64_t n = atomic_fetch_add(&e->calls[c], 1) + 1;
    uint64_t f = atomic_load(&e->faults[c]);
    if (SPW_LIKELY(!f)) return SPW_OK;
    uint64_t at = f & ~EMU_PERSIST;
    if (n != at && !((f & EMU_PERSIST) && n > at)) return SPW_OK;
    int oom = c == SPW_CALL_DEV_ALLOC || c == SPW_CALL_MAP || c == SPW_CALL_MANAGED_ALLOC ||
              c == SPW_CALL_HOST_ALLOC; /* what CUDA reports: cudaErrorMemoryAllocation */
    return spw__error(oom ? SPW_ERR_OUT_OF_MEMORY : SPW_ERR_BACKEND,
                      "emu: injected fault in %s (call #%llu)", spw__call_name(c),
                      (unsigned long long)n);
}

#define ENTER(e, call)                                                                         \
    do {                                                                                       \
        spw_status st_ = enter((e), SPW_CALL_##call);                                          \
        if (st_ != SPW_OK) return st_;                                                         \
    } while (0)

int spw__backend_is_emu(const spw_backend *b) {
    return b && b->ops && b->ops->destroy == emu_destroy;
}

void spw__emu_inject(spw_backend *b, spw_call call, unsigned long n, int persistent) {
    if (!spw__backend_is_emu(b) || (unsigned)call >= SPW_CALL_COUNT_) return;
    emu_backend *e = EMU(b);
    uint64_t v = n ? (atomic_load(&e->calls[call]) + n) | (persistent ? EMU_PERSIST : 0) : 0;
    atomic_store(&e->faults[call], v);
}

void spw__emu_clear_faults(spw_backend *b) {
    if (!spw__backend_is_emu(b)) return;
    for (int c = 0; c < SPW_CALL_COUNT_; c++) atomic_store(&EMU(b)->faults[c], 0);
}

unsigned long spw__emu_calls(spw_backend *b, spw_call call) {
    if (!spw__backend_is_emu(b) || (unsigned)call >= SPW_CALL_COUNT_) return 0;
    return (unsigned long)atomic_load(&EMU(b)->calls[call]);
}

size_t spw__emu_used(spw_backend *b) {
    if (!spw__backend_is_emu(b)) return 0;
    pthread_mutex_lock(&EMU(b)->mem_lock);
    size_t u = EMU(b)->used;
    pthread_mutex_unlock(&EMU(b)->mem_lock);
    return u;
}

/* ---- memory ---- */

/* Anonymous mapping of `bytes` aligned to `align` (a power of two >= page), or NULL. */
static void *map_aligned(emu_backend *e, size_t bytes, size_t align, int prot, int flags) {
    size_t len = SPW_ALIGN_UP(bytes, e->page);
    if (len < bytes || len + align < len) return NULL;
    flags |= MAP_PRIVATE | MAP_ANONYMOUS;
    /* Try the exact size first: large mappings usually come back aligned, and address space
     * may be short (ThreadSanitizer leaves about 1 TiB). Else over-map and trim. */
    char *p = mmap(NULL, len, prot, flags, -1, 0);
    if (p != MAP_FAILED && (uintptr_t)p % align == 0) return p;
    if (p != MAP_FAILED) munmap(p, len);
    if ((p = mmap(NULL, len + align, prot, flags, -1, 0)) == MAP_FAILED) return NULL;
    char *a = (char *)SPW_ALIGN_UP((uintptr_t)p, align);
    if (a > p) munmap(p, (size_t)(a - p));
    if (a + len < p + len + align) munmap(a + len, (size_t)(p + align - a));
    return a;
}

/* The out-of-memory status for a request past capacity. mem_lock held. */
static spw_status oom(emu_backend *e, const char *call, size_t bytes) {
    char r[48], u[48], c[48];
    return spw__error(SPW_ERR_OUT_OF_MEMORY,
                      "emu: %s of %s: out of device memory (used %s of capacity %s)", call,
                      spw__fmt_bytes(r, sizeof r, bytes), spw__fmt_bytes(u, sizeof u, e->used),
                      spw__fmt_bytes(c, sizeof c, e->capacity));
}

/* Map `bytes` and record it in *table; charge it to capacity when `charge` (device memory,
 * which is also MAP_NORESERVE: committed only when touched). */
static spw_status alloc_into(emu_backend *e, emu_alloc **table, size_t bytes, int charge,
                             const char *call, void **out) {
    int hash_oom_ = 0;
    if (!out || !bytes)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: %s(bytes=%zu, out=%p): %s", call,
                          bytes, (void *)out, !out ? "out is NULL" : "size is 0");
    spw_status st = SPW_OK;
    pthread_mutex_lock(&e->mem_lock);
    if (charge && bytes > e->capacity - e->used) {
        st = oom(e, call, bytes);
        goto done;
    }
    emu_alloc *a = calloc(1, sizeof *a);
    void *p = a ? map_aligned(e, bytes, e->page, PROT_READ | PROT_WRITE, charge ? MAP_NORESERVE : 0)
                : NULL;
    if (p) {
        *a = (emu_alloc){.ptr = p, .bytes = bytes, .map_bytes = SPW_ALIGN_UP(bytes, e->page)};
        HASH_ADD_PTR(*table, ptr, a);
    }
    if (!p || hash_oom_) {
        int err = errno;
        if (p) munmap(p, a->map_bytes);
        free(a);
        st = spw__error(SPW_ERR_OUT_OF_MEMORY, "emu: %s of %zu bytes: host mapping failed: %s",
                        call, bytes, strerror(err));
        goto done;
    }
    if (charge) e->used += bytes;
    *out = p;
done:
    pthread_mutex_unlock(&e->mem_lock);
    return st;
}

/* Unmap and forget ptr from *table (NULL is a no-op); refund when `charge`. */
static spw_status free_from(emu_backend *e, emu_alloc **table, void *ptr, int charge,
                            const char *call, const char *alloc_call) {
    if (!ptr) return SPW_OK;
    emu_alloc *a = NULL;
    pthread_mutex_lock(&e->mem_lock);
    HASH_FIND_PTR(*table, &ptr, a);
    if (a) {
        HASH_DEL(*table, a);
        if (charge) e->used -= a->bytes;
    }
    pthread_mutex_unlock(&e->mem_lock);
    if (!a)
        return spw__error(SPW_ERR_NOT_FOUND, "emu: %s(%p): not a live pointer from %s", call,
                          ptr, alloc_call);
    munmap(a->ptr, a->map_bytes);
    free(a);
    return SPW_OK;
}

static spw_status emu_dev_alloc(spw_backend *b, size_t bytes, void **out) {
    ENTER(EMU(b), DEV_ALLOC);
    return alloc_into(EMU(b), &EMU(b)->devs, bytes, 1, "dev_alloc", out);
}

static spw_status emu_dev_free(spw_backend *b, void *ptr) {
    ENTER(EMU(b), DEV_FREE);
    return free_from(EMU(b), &EMU(b)->devs, ptr, 1, "dev_free", "dev_alloc");
}

static spw_status emu_host_alloc(spw_backend *b, size_t bytes, void **out) {
    ENTER(EMU(b), HOST_ALLOC);
    return alloc_into(EMU(b), &EMU(b)->hosts, bytes, 0, "host_alloc", out);
}

static spw_status emu_host_free(spw_backend *b, void *ptr) {
    ENTER(EMU(b), HOST_FREE);
    return free_from(EMU(b), &EMU(b)->hosts, ptr, 0, "host_free", "host_alloc");
}

static spw_status emu_managed_alloc(spw_backend *b, size_t bytes, void **out) {
    ENTER(EMU(b), MANAGED_ALLOC);
    return alloc_into(EMU(b), &EMU(b)->manageds, bytes, 1, "managed_alloc", out);
}

static spw_status emu_managed_free(spw_backend *b, void *ptr) {
    ENTER(EMU(b), DEV_FREE);
    return free_from(EMU(b), &EMU(b)->manageds, ptr, 1, "managed_free", "managed_alloc");
}

/* The entry of `table` that contains [p, p+bytes) (inside=1) or overlaps it (inside=0), or
 * NULL. mem_lock held. */
static emu_alloc *find_range(emu_alloc *table, const void *p, size_t bytes, int inside) {
    uintptr_t lo = (uintptr_t)p;
    for (emu_alloc *a = table; a; a = a->hh.next) {
        uintptr_t base = (uintptr_t)a->ptr;
        if (inside ? lo >= base && lo - base < a->bytes && bytes <= a->bytes - (lo - base)
                   : lo < base + a->bytes && base < lo + bytes)
            return a;
    }
    return NULL;
}

/* Registering a range that overlaps a registered or host_alloc'ed one is SPW_ERR_STATE, like
 * cudaErrorHostMemoryAlreadyRegistered. */
static spw_status emu_host_register(spw_backend *b, void *ptr, size_t bytes) {
    emu_backend *e = EMU(b);
    int hash_oom_ = 0;
    ENTER(e, HOST_REGISTER);
    if (!ptr || !bytes || (uintptr_t)ptr + bytes < (uintptr_t)ptr)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: host_register(%p, %zu): bad range",
                          ptr, bytes);
    spw_status st = SPW_OK;
    pthread_mutex_lock(&e->mem_lock);
    emu_alloc *a = find_range(e->regs, ptr, bytes, 0);
    if (!a) a = find_range(e->hosts, ptr, bytes, 0);
    if (a) {
        st = spw__error(SPW_ERR_STATE,
                        "emu: host_register(%p, %zu): overlaps pinned range %p (%zu bytes)", ptr,
                        bytes, a->ptr, a->bytes);
    } else if ((a = calloc(1, sizeof *a)) != NULL) {
        a->ptr = ptr;
        a->bytes = bytes;
        HASH_ADD_PTR(e->regs, ptr, a);
    }
    if (st == SPW_OK && (!a || hash_oom_)) {
        free(a);
        st = spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: host_register: out of memory");
    }
    pthread_mutex_unlock(&e->mem_lock);
    return st;
}

static spw_status emu_host_unregister(spw_backend *b, void *ptr) {
    emu_backend *e = EMU(b);
    ENTER(e, HOST_UNREGISTER);
    emu_alloc *a = NULL;
    pthread_mutex_lock(&e->mem_lock);
    HASH_FIND_PTR(e->regs, &ptr, a);
    if (a) HASH_DEL(e->regs, a);
    pthread_mutex_unlock(&e->mem_lock);
    if (!a) return spw__error(SPW_ERR_NOT_FOUND, "emu: host_unregister(%p): not registered", ptr);
    free(a);
    return SPW_OK;
}

/* Validated and recorded on the allocation; the emulation has nothing to migrate. */
static spw_status emu_managed_advise(spw_backend *b, void *ptr, size_t bytes,
                                     spw_managed_advice adv) {
    emu_backend *e = EMU(b);
    ENTER(e, MANAGED_ADVISE);
    if (!ptr || !bytes || (unsigned)adv > SPW_ADVISE_UNSET_READ_MOSTLY)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: managed_advise(%p, %zu, advice %d)",
                          ptr, bytes, (int)adv);
    pthread_mutex_lock(&e->mem_lock);
    emu_alloc *a = find_range(e->manageds, ptr, bytes, 1);
    if (a) a->advice |= 1u << adv;
    pthread_mutex_unlock(&e->mem_lock);
    if (!a)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: managed_advise(%p, %zu): not inside a managed allocation", ptr,
                          bytes);
    return SPW_OK;
}

/* ---- virtual memory ---- */

/* bytes must be a positive multiple of the granularity; the address is granule-aligned. */
static spw_status emu_va_reserve(spw_backend *b, size_t bytes, void **va) {
    emu_backend *e = EMU(b);
    ENTER(e, VA_RESERVE);
    if (!va || !bytes || bytes % e->gran)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: va_reserve(bytes=%zu, out=%p): need an out pointer and a "
                          "positive multiple of the granularity %zu",
                          bytes, (void *)va, e->gran);
    size_t granules = bytes / e->gran;
    emu_resv *r = calloc(1, sizeof *r);
    uint64_t *bits = calloc((granules + 63) / 64, sizeof *bits);
    char *p = r && bits ? map_aligned(e, bytes, e->gran, PROT_NONE, MAP_NORESERVE) : NULL;
    if (!p) {
        int err = errno;
        free(r);
        free(bits);
        return spw__error(SPW_ERR_OUT_OF_MEMORY, "emu: va_reserve of %zu bytes failed: %s",
                          bytes, strerror(err));
    }
    *r = (emu_resv){.va = p, .bytes = bytes, .bits = bits};
    pthread_mutex_lock(&e->mem_lock);
    r->next = e->resvs;
    e->resvs = r;
    pthread_mutex_unlock(&e->mem_lock);
    *va = p;
    return SPW_OK;
}

/* va and bytes must be those of one va_reserve, with nothing mapped in it. */
static spw_status emu_va_release(spw_backend *b, void *va, size_t bytes) {
    emu_backend *e = EMU(b);
    ENTER(e, VA_RELEASE);
    spw_status st = SPW_OK;
    pthread_mutex_lock(&e->mem_lock);
    emu_resv **pp = &e->resvs, *r;
    while (*pp && (*pp)->va != va) pp = &(*pp)->next;
    if (!(r = *pp))
        st = spw__error(SPW_ERR_NOT_FOUND, "emu: va_release(%p): not a reservation", va);
    else if (bytes != r->bytes)
        st = spw__error(SPW_ERR_INVALID_ARGUMENT,
                        "emu: va_release(%p, %zu): the reservation has %zu bytes", va, bytes,
                        r->bytes);
    else if (r->mapped)
        st = spw__error(SPW_ERR_STATE,
                        "emu: va_release(%p, %zu): %zu bytes are still mapped; unmap them first",
                        va, bytes, r->mapped * e->gran);
    else
        *pp = r->next;
    pthread_mutex_unlock(&e->mem_lock);
    if (st != SPW_OK) return st;
    munmap(r->va, r->bytes);
    free(r->bits);
    free(r);
    return SPW_OK;
}

/* Are granule bits [first, first+n) all `set`? If not, *bad is the first that is not. */
static int bits_all(const uint64_t *bits, size_t first, size_t n, int set, size_t *bad) {
    for (size_t i = first; i < first + n; i++)
        if (((bits[i / 64] >> (i % 64)) & 1) != (uint64_t)set) return *bad = i, 0;
    return 1;
}

static void bits_put(uint64_t *bits, size_t first, size_t n, int set) {
    for (size_t i = first; i < first + n; i++)
        bits[i / 64] = set ? bits[i / 64] | (uint64_t)1 << (i % 64)
                           : bits[i / 64] & ~((uint64_t)1 << (i % 64));
}

/* Validate a map/unmap range, find its reservation, and check that its granules are all
 * mapped (want_set=1) or all unmapped. mem_lock held. */
static spw_status vm_range(emu_backend *e, const char *call, void *va, size_t bytes,
                           int want_set, emu_resv **out, size_t *first) {
    if (!va || !bytes || (uintptr_t)va % e->gran || bytes % e->gran)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: %s(%p, %zu): address and size must be non-zero multiples of the "
                          "granularity %zu",
                          call, va, bytes, e->gran);
    uintptr_t lo = (uintptr_t)va;
    emu_resv *r = e->resvs;
    while (r && !(lo >= (uintptr_t)r->va && lo - (uintptr_t)r->va < r->bytes &&
                  bytes <= r->bytes - (lo - (uintptr_t)r->va)))
        r = r->next;
    if (!r)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: %s(%p, %zu): not inside one reservation", call, va, bytes);
    size_t bad = 0;
    *first = (lo - (uintptr_t)r->va) / e->gran;
    if (!bits_all(r->bits, *first, bytes / e->gran, want_set, &bad))
        return spw__error(SPW_ERR_STATE, "emu: %s(%p, %zu): the granule at %p is %s", call, va,
                          bytes, (void *)(r->va + bad * e->gran),
                          want_set ? "not mapped" : "already mapped");
    *out = r;
    return SPW_OK;
}

static spw_status emu_map(spw_backend *b, void *va, size_t bytes) {
    emu_backend *e = EMU(b);
    ENTER(e, MAP);
    emu_resv *r = NULL;
    size_t first = 0;
    pthread_mutex_lock(&e->mem_lock);
    spw_status st = vm_range(e, "map", va, bytes, 0, &r, &first);
    if (st == SPW_OK && bytes > e->capacity - e->used)
        st = oom(e, "map", bytes);
    else if (st == SPW_OK && mprotect(va, bytes, PROT_READ | PROT_WRITE) != 0)
        st = spw__error(SPW_ERR_OUT_OF_MEMORY, "emu: map(%p, %zu): mprotect failed: %s", va,
                        bytes, strerror(errno));
    if (st == SPW_OK) {
        bits_put(r->bits, first, bytes / e->gran, 1);
        r->mapped += bytes / e->gran;
        e->used += bytes;
    }
    pthread_mutex_unlock(&e->mem_lock);
    return st;
}

/* Protect first: if that fails nothing has changed. Then drop the pages, returning the RAM. */
static spw_status emu_unmap(spw_backend *b, void *va, size_t bytes) {
    emu_backend *e = EMU(b);
    ENTER(e, UNMAP);
    emu_resv *r = NULL;
    size_t first = 0;
    pthread_mutex_lock(&e->mem_lock);
    spw_status st = vm_range(e, "unmap", va, bytes, 1, &r, &first);
    if (st == SPW_OK && mprotect(va, bytes, PROT_NONE) != 0)
        st = spw__error(SPW_ERR_BACKEND, "emu: unmap(%p, %zu): mprotect failed: %s", va, bytes,
                        strerror(errno));
    if (st == SPW_OK) {
        madvise(va, bytes, MADV_DONTNEED);
        bits_put(r->bits, first, bytes / e->gran, 0);
        r->mapped -= bytes / e->gran;
        e->used -= bytes;
    }
    pthread_mutex_unlock(&e->mem_lock);
    return st;
}

/* ---- streams: workers and queues ---- */

/* Make a transfer of `bytes` that started at t0 last at least bytes / rate. */
static void throttle(const emu_backend *e, size_t bytes, uint64_t t0) {
    if (e->gbps <= 0) return;
    uint64_t want = (uint64_t)((double)bytes / e->gbps); /* GB/s == bytes/ns */
    uint64_t took = spw__now_ns() - t0;
    if (want <= took) return;
    struct timespec ts = {(time_t)((want - took) / 1000000000u),
                          (long)((want - took) % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Block until stream s has finished item `seq`. q_lock held. */
static void wait_done(emu_backend *e, const emu_stream *s, uint64_t seq) {
    while (s->done_seq < seq) {
        e->done_waiters++;
        pthread_cond_wait(&e->cv_done, &e->q_lock);
        e->done_waiters--;
    }
}

/* The worker of one stream: runs its items in order until stopped with an empty queue. */
static void *worker(void *arg) {
    emu_stream *s = arg;
    emu_backend *e = s->b;
    pthread_mutex_lock(&e->q_lock);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv_work, &e->q_lock);
        emu_item *it = s->head;
        if (!it) break;
        if (it->kind == W_WAIT) {
            wait_done(e, it->u.wait.s, it->u.wait.seq);
        } else {
            /* Enqueuers may write it->next meanwhile; only the payload is read unlocked. */
            pthread_mutex_unlock(&e->q_lock);
            uint64_t t0 = spw__now_ns();
            if (it->kind == W_HOST) {
                it->u.host.fn(it->u.host.arg);
            } else if (it->kind == W_COPY) {
                memmove(it->u.copy.dst, it->u.copy.src, it->u.copy.bytes);
                if (it->u.copy.timed) throttle(e, it->u.copy.bytes, t0);
            } else {
                throttle(e, it->u.prefetch_bytes, t0);
            }
            pthread_mutex_lock(&e->q_lock);
        }
        if (!(s->head = it->next)) s->tail = NULL;
        s->done_seq = it->seq;
        it->next = e->free_items;
        e->free_items = it;
        if (e->done_waiters) pthread_cond_broadcast(&e->cv_done);
    }
    pthread_mutex_unlock(&e->q_lock);
    return NULL;
}

/* The stream behind a handle (NULL: the default stream); NULL with the message set if the
 * handle is unknown or destroyed. q_lock held. */
static emu_stream *stream_get(emu_backend *e, spw_stream h, const char *call) {
    void *k = (void *)h;
    emu_stream *s = h ? NULL : e->def;
    if (h) HASH_FIND_PTR(e->live, &k, s);
    if (!s)
        spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: %s: unknown or destroyed stream %p", call, k);
    return s;
}

/* Append an item to s, returned for the caller to fill before unlocking; NULL with the
 * message set when out of memory. Items are recycled: no allocation in the steady state. */
static emu_item *enqueue(emu_backend *e, emu_stream *s, emu_work kind, const char *call) {
    emu_item *it = e->free_items;
    if (it) {
        e->free_items = it->next;
    } else if (!(it = malloc(sizeof *it))) {
        spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: %s: out of memory for a work item", call);
        return NULL;
    }
    it->next = NULL;
    it->kind = kind;
    it->seq = ++s->enq_seq;
    if (s->tail) {
        s->tail->next = it;
    } else {
        s->head = it;
        pthread_cond_signal(&s->cv_work);
    }
    return s->tail = it;
}

/* Drain s, stop its worker, join it and park the struct for reuse. q_lock held (released
 * while joining). */
static void stream_stop(emu_backend *e, emu_stream *s) {
    wait_done(e, s, s->enq_seq);
    s->stop = 1;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&e->q_lock);
    pthread_join(s->thread, NULL);
    pthread_mutex_lock(&e->q_lock);
    s->next_dead = e->dead;
    e->dead = s;
}

/* A stream struct with a running worker: a recycled one (its sequence numbers keep counting)
 * or a new one. Called without q_lock. */
static spw_status stream_start(emu_backend *e, emu_stream **out) {
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = e->dead;
    if (s) e->dead = s->next_dead;
    pthread_mutex_unlock(&e->q_lock);
    int fresh = !s, rc = ENOMEM;
    if (fresh && (s = calloc(1, sizeof *s)) != NULL) {
        s->b = e;
        s->key = s;
        if (pthread_cond_init(&s->cv_work, NULL) != 0) {
            free(s);
            s = NULL;
        }
    }
    if (s) {
        s->stop = 0;
        rc = pthread_create(&s->thread, NULL, worker, s);
    }
    pthread_mutex_lock(&e->q_lock);
    if (s && rc != 0) { /* park it; a fresh one is on `all` to be freed with the backend */
        s->next_dead = e->dead;
        e->dead = s;
    }
    if (s && fresh) {
        s->next_all = e->all;
        e->all = s;
    }
    pthread_mutex_unlock(&e->q_lock);
    if (rc != 0)
        return spw__error(SPW_ERR_BACKEND, "emu: stream_create: cannot start a worker: %s",
                          strerror(rc));
    *out = s;
    return SPW_OK;
}

static spw_status emu_stream_create(spw_backend *b, spw_stream *out) {
    emu_backend *e = EMU(b);
    int hash_oom_ = 0;
    ENTER(e, STREAM_CREATE);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: stream_create: out is NULL");
    emu_stream *s = NULL;
    spw_status st = stream_start(e, &s);
    if (st != SPW_OK) return st;
    pthread_mutex_lock(&e->q_lock);
    HASH_ADD_PTR(e->live, key, s);
    if (hash_oom_) stream_stop(e, s);
    pthread_mutex_unlock(&e->q_lock);
    if (hash_oom_)
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: stream_create: out of memory");
    *out = (spw_stream)s;
    return SPW_OK;
}

/* Waits for the stream's work, then ends its worker (cudaStreamDestroy returns at once; waiting
 * is equivalent for callers, who may not use the handle afterwards). */
static spw_status emu_stream_destroy(spw_backend *b, spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, STREAM_DESTROY);
    if (!h)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: stream_destroy: the default stream cannot be destroyed");
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = stream_get(e, h, "stream_destroy");
    if (s) {
        HASH_DEL(e->live, s); /* from here on, new work for it is refused */
        stream_stop(e, s);
    }
    pthread_mutex_unlock(&e->q_lock);
    return s ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

static spw_status emu_stream_sync(spw_backend *b, spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, STREAM_SYNC);
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = stream_get(e, h, "stream_sync");
    if (s) wait_done(e, s, s->enq_seq);
    pthread_mutex_unlock(&e->q_lock);
    return s ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

/* Enqueue an item with proto's kind and payload on h. */
static spw_status submit(emu_backend *e, const char *call, spw_stream h, const emu_item *proto) {
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = stream_get(e, h, call);
    emu_item *it = s ? enqueue(e, s, proto->kind, call) : NULL;
    if (it) it->u = proto->u;
    pthread_mutex_unlock(&e->q_lock);
    return it ? SPW_OK : s ? SPW_ERR_HOST_OUT_OF_MEMORY : SPW_ERR_INVALID_ARGUMENT;
}

/* The emulation does not check that pointers match the kind; kind only decides whether the
 * simulated link bandwidth applies (H2D, D2H). Zero bytes enqueue an ordered no-op. */
static spw_status emu_memcpy_async(spw_backend *b, void *dst, const void *src, size_t bytes,
                                   spw_copy_kind kind, spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, MEMCPY);
    if ((unsigned)kind > SPW_COPY_H2H || (bytes && (!dst || !src)))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: memcpy(dst=%p, src=%p, %zu bytes, kind %d): bad argument", dst,
                          src, bytes, (int)kind);
    emu_item it = {.kind = W_COPY};
    it.u.copy.dst = dst;
    it.u.copy.src = src;
    it.u.copy.bytes = bytes;
    it.u.copy.timed = kind == SPW_COPY_H2D || kind == SPW_COPY_D2H;
    return submit(e, "memcpy", h, &it);
}

static spw_status emu_launch_host(spw_backend *b, spw_stream h, void (*fn)(void *), void *arg) {
    emu_backend *e = EMU(b);
    ENTER(e, LAUNCH_HOST);
    if (!fn) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: launch_host: fn is NULL");
    emu_item it = {.kind = W_HOST};
    it.u.host.fn = fn;
    it.u.host.arg = arg;
    return submit(e, "launch_host", h, &it);
}

/* An ordered no-op (timed like a copy when a bandwidth is set) on a managed range. */
static spw_status emu_prefetch(spw_backend *b, void *ptr, size_t bytes, int to_device,
                               spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, PREFETCH);
    if (!e->managed)
        return spw__error(SPW_ERR_UNSUPPORTED,
                          "emu: prefetch: this emulated device has no concurrent managed access");
    pthread_mutex_lock(&e->mem_lock);
    emu_alloc *a = ptr && bytes ? find_range(e->manageds, ptr, bytes, 1) : NULL;
    pthread_mutex_unlock(&e->mem_lock);
    if (!a)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: prefetch(%p, %zu, to %s): not inside a managed allocation", ptr,
                          bytes, to_device ? "device" : "host");
    emu_item it = {.kind = W_PREFETCH, .u.prefetch_bytes = bytes};
    return submit(e, "prefetch", h, &it);
}

/* ---- events ---- */

/* The event behind a handle; NULL with the message set if unknown. q_lock held. */
static emu_event *event_get(emu_backend *e, spw_event h, const char *call) {
    void *k = (void *)h;
    emu_event *ev = NULL;
    if (h) HASH_FIND_PTR(e->events, &k, ev);
    if (!ev)
        spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: %s: unknown or destroyed event %p", call, k);
    return ev;
}

static spw_status emu_event_create(spw_backend *b, spw_event *out) {
    emu_backend *e = EMU(b);
    int hash_oom_ = 0;
    ENTER(e, EVENT_CREATE);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: event_create: out is NULL");
    emu_event *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->key = ev;
        pthread_mutex_lock(&e->q_lock);
        HASH_ADD_PTR(e->events, key, ev);
        pthread_mutex_unlock(&e->q_lock);
    }
    if (!ev || hash_oom_) {
        free(ev);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: event_create: out of memory");
    }
    *out = (spw_event)ev;
    return SPW_OK;
}

/* Allowed while the event is pending: waits already enqueued captured its position. */
static spw_status emu_event_destroy(spw_backend *b, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_DESTROY);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_destroy");
    if (ev) HASH_DEL(e->events, ev);
    pthread_mutex_unlock(&e->q_lock);
    free(ev);
    return ev ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

/* Captures the position; allocates nothing and enqueues nothing. */
static spw_status emu_event_record(spw_backend *b, spw_event h, spw_stream sh) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_RECORD);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_record");
    emu_stream *s = ev ? stream_get(e, sh, "event_record") : NULL;
    if (s) {
        ev->rec = s;
        ev->rec_seq = s->enq_seq;
    }
    pthread_mutex_unlock(&e->q_lock);
    return s ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

static spw_status emu_event_query(spw_backend *b, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_QUERY);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_query");
    int done = ev && (!ev->rec || ev->rec->done_seq >= ev->rec_seq);
    pthread_mutex_unlock(&e->q_lock);
    if (!ev) return SPW_ERR_INVALID_ARGUMENT;
    if (done) return SPW_OK;
    return spw__error(SPW_ERR_NOT_READY, "emu: event_query: event %p not complete", (void *)h);
}

/* Waits for the record current at the call; a concurrent re-record is not waited for. */
static spw_status emu_event_sync(spw_backend *b, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_SYNC);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_sync");
    if (ev && ev->rec) wait_done(e, ev->rec, ev->rec_seq);
    pthread_mutex_unlock(&e->q_lock);
    return ev ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

static spw_status emu_stream_wait(spw_backend *b, spw_stream sh, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, STREAM_WAIT);
    spw_status st = SPW_ERR_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "stream_wait");
    emu_stream *s = ev ? stream_get(e, sh, "stream_wait") : NULL;
    if (s) {
        st = SPW_OK;
        /* Only a pending point on another stream needs an item; FIFO orders the rest. */
        if (ev->rec && ev->rec != s && ev->rec->done_seq < ev->rec_seq) {
            emu_item *it = enqueue(e, s, W_WAIT, "stream_wait");
            if (it) {
                it->u.wait.s = ev->rec;
                it->u.wait.seq = ev->rec_seq;
            } else {
                st = SPW_ERR_HOST_OUT_OF_MEMORY;
            }
        }
    }
    pthread_mutex_unlock(&e->q_lock);
    return st;
}

/* ---- device info, create, destroy ---- */

static spw_status emu_mem_info(spw_backend *b, size_t *free_bytes, size_t *total_bytes) {
    emu_backend *e = EMU(b);
    ENTER(e, MEM_INFO);
    if (!free_bytes || !total_bytes)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: mem_info: NULL output");
    pthread_mutex_lock(&e->mem_lock);
    *free_bytes = e->capacity - e->used;
    *total_bytes = e->capacity;
    pthread_mutex_unlock(&e->mem_lock);
    return SPW_OK;
}

/* Counted as mem_info: it is that query plus constants. */
static spw_status emu_device_info(spw_backend *b, spw_device_info *out) {
    emu_backend *e = EMU(b);
    ENTER(e, MEM_INFO);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: device_info: out is NULL");
    /* pageable_memory_access 0: like a discrete PCIe device without HMM */
    *out = (spw_device_info){.name = "spillway emu device", .total_bytes = e->capacity,
                             .cc_major = 9, .vmm_supported = e->vmm, .vmm_granularity = e->gran,
                             .concurrent_managed_access = e->managed, .emulated = 1};
    pthread_mutex_lock(&e->mem_lock);
    out->free_bytes = e->capacity - e->used;
    pthread_mutex_unlock(&e->mem_lock);
    return SPW_OK;
}

static void free_table(emu_alloc **table) {
    emu_alloc *a, *tmp;
    HASH_ITER(hh, *table, a, tmp) {
        HASH_DEL(*table, a);
        if (a->map_bytes) munmap(a->ptr, a->map_bytes);
        free(a);
    }
}

/* Waits for all streams' work, joins the workers and returns every resource still held. The
 * caller guarantees that no other thread uses the backend meanwhile. */
static void emu_destroy(spw_backend *b) {
    emu_backend *e = EMU(b);
    if (!e) return;
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s, *tmp;
    HASH_ITER(hh, e->live, s, tmp) {
        HASH_DEL(e->live, s);
        stream_stop(e, s);
    }
    if (e->def) stream_stop(e, e->def);
    pthread_mutex_unlock(&e->q_lock);
    for (s = e->all; s; s = tmp) { /* the default stream is on `all` too */
        tmp = s->next_all;
        pthread_cond_destroy(&s->cv_work);
        free(s);
    }
    for (emu_item *it = e->free_items, *n; it; it = n) {
        n = it->next;
        free(it);
    }
    emu_event *ev, *etmp;
    HASH_ITER(hh, e->events, ev, etmp) {
        HASH_DEL(e->events, ev);
        free(ev);
    }
    free_table(&e->devs);
    free_table(&e->manageds);
    free_table(&e->hosts);
    free_table(&e->regs);
    for (emu_resv *r = e->resvs, *n; r; r = n) {
        n = r->next;
        munmap(r->va, r->bytes);
        free(r->bits);
        free(r);
    }
    pthread_cond_destroy(&e->cv_done);
    pthread_mutex_destroy(&e->q_lock);
    pthread_mutex_destroy(&e->mem_lock);
    free(e);
}

static const spw_backend_ops emu_ops = {
    .name = "emu",
    .destroy = emu_destroy,
    .device_info = emu_device_info,
    .mem_info = emu_mem_info,
    .dev_alloc = emu_dev_alloc,
    .dev_free = emu_dev_free,
    .va_reserve = emu_va_reserve,
    .va_release = emu_va_release,
    .map = emu_map,
    .unmap = emu_unmap,
    .host_alloc = emu_host_alloc,
    .host_free = emu_host_free,
    .host_register = emu_host_register,
    .host_unregister = emu_host_unregister,
    .managed_alloc = emu_managed_alloc,
    .managed_free = emu_managed_free,
    .managed_advise = emu_managed_advise,
    .prefetch = emu_prefetch,
    .stream_create = emu_stream_create,
    .stream_destroy = emu_stream_destroy,
    .stream_sync = emu_stream_sync,
    .event_create = emu_event_create,
    .event_destroy = emu_event_destroy,
    .event_record = emu_event_record,
    .event_query = emu_event_query,
    .event_sync = emu_event_sync,
    .stream_wait = emu_stream_wait,
    .memcpy_async = emu_memcpy_async,
    .launch_host = emu_launch_host,
};

/* p may be NULL (all defaults). The granularity must be a power of two and a multiple of the
 * host page size. Starts the default stream's worker. */
spw_status spw__backend_emu_create(const spw_backend_params *p, spw_backend **out) {
    static const spw_backend_params defaults = {0};
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: create: out is NULL");
    *out = NULL;
    if (!p) p = &defaults;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t gran = p->emu_granularity ? p->emu_granularity : 2 * SPW_MiB;
    if ((gran & (gran - 1)) || gran % page || !(p->emu_h2d_gbps >= 0))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: create: granularity %zu must be a power of two and a multiple "
                          "of the page size %zu; bandwidth %g GB/s must be >= 0",
                          gran, page, p->emu_h2d_gbps);
    emu_backend *e = calloc(1, sizeof *e);
    if (!e) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: create: out of memory");
    e->ops = emu_ops;
    e->base.ops = &e->ops;
    e->base.device = p->device;
    e->capacity = p->emu_capacity ? p->emu_capacity : 80 * SPW_GiB;
    e->gran = gran;
    e->page = page;
    e->vmm = p->emu_vmm >= 0;
    e->managed = p->emu_managed >= 0;
    e->gbps = p->emu_h2d_gbps;
    if (!e->vmm) { /* backend.h: the VMM ops are NULL when unsupported */
        e->ops.va_reserve = NULL;
        e->ops.va_release = NULL;
        e->ops.map = NULL;
        e->ops.unmap = NULL;
    }
    for (int c = 0; c < SPW_CALL_COUNT_; c++) {
        atomic_init(&e->calls[c], 0);
        atomic_init(&e->faults[c], 0);
    }
    /* With default attributes these cannot fail on Linux (glibc documents no error). */
    pthread_mutex_init(&e->mem_lock, NULL);
    pthread_mutex_init(&e->q_lock, NULL);
    pthread_cond_init(&e->cv_done, NULL);
    spw_status st = stream_start(e, &e->def);
    if (st != SPW_OK) {
        emu_destroy(&e->base);
        return st;
    }
    *out = &e->base;
    return SPW_OK;
}
