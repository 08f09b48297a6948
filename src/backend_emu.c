/*
 * emu: a device emulated in host memory, for machines without a GPU and for deterministic tests.
 *
 * Model (beyond the contracts in backend.h):
 * - Device memory is anonymous host memory mapped MAP_NORESERVE, so untouched device bytes cost
 *   no RAM. "used" (dev_alloc + mapped pages + managed) never exceeds the capacity; managed
 *   memory is charged in full at allocation, as if always resident on the device. Charges are
 *   the requested bytes, unrounded.
 * - VMM: va_reserve maps PROT_NONE address space aligned to its page (the granularity or a
 *   power-of-two multiple); map makes pages read/write and charges them; unmap may release ANY
 *   page-aligned subrange of mapped memory (more permissive than cuMemUnmap, which wants whole
 *   earlier maps); ranges not aligned to the reservation's page are SPW_ERR_INVALID_ARGUMENT, as
 *   on cuda. A bitmap per reservation makes double maps and unmaps of unmapped memory
 *   SPW_ERR_STATE. va_release of a reservation that still has mapped pages is SPW_ERR_STATE and
 *   changes nothing.
 * - Every vtable function counts its call kind and checks for an injected fault before anything
 *   else; a fault has no side effect. device_info counts as mem_info, managed_free as dev_free
 *   (cudaFree frees managed memory too).
 * - free(NULL) (dev_free, host_free, managed_free) succeeds and does nothing, like cudaFree.
 * - Params: a 0 field means the default (80 GiB, 2 MiB, vmm on, managed on); emu_vmm < 0 or
 *   emu_managed < 0 turns the feature off. Without vmm the va_* and map/unmap ops are NULL;
 *   without managed, prefetch is SPW_ERR_UNSUPPORTED (as on a device without concurrent
 *   managed access). emu_h2d_gbps > 0 makes H2D/D2H copies and prefetches take bytes/rate.
 * Streams, events and their worker threads are in emu_stream.c; the state both halves share,
 * the lock rules and the cross-file functions are in backend_emu.h.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend_emu.h"

static void emu_destroy(spw_backend *b);

/* ---- call counting and fault injection ---- */

/* Count the call; fail it (before any side effect) when a fault is armed for its number. */
spw_status spw__emu_enter(emu_backend *e, spw_call c) {
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

/* What an allocation counts against: the device's capacity, or the bytes the host can page-lock
 * (pin_limit, as a system that limits pinned memory has). */
enum { CHARGE_DEVICE = 1, CHARGE_PINNED };

/* SPW_ERR_HOST_OUT_OF_MEMORY when page-locking `bytes` more would pass pin_limit. mem_lock held. */
static spw_status pin_room(emu_backend *e, const char *call, size_t bytes) {
    if (!e->pin_limit || bytes <= e->pin_limit - e->pinned_host) return SPW_OK;
    return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                      "emu: %s of %zu bytes: %zu of the %zu bytes that can be page-locked are in use", call,
                      bytes, e->pinned_host, e->pin_limit);
}

/* Map `bytes` and record it in *table; charge it to what `charge` names (device memory is also
 * MAP_NORESERVE: committed only when touched). */
static spw_status alloc_into(emu_backend *e, emu_alloc **table, size_t bytes, int charge,
                             const char *call, void **out) {
    int hash_oom_ = 0;
    if (!out || !bytes)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: %s(bytes=%zu, out=%p): %s", call,
                          bytes, (void *)out, !out ? "out is NULL" : "size is 0");
    spw_status st = SPW_OK;
    pthread_mutex_lock(&e->mem_lock);
    if (charge == CHARGE_DEVICE && bytes > e->capacity - e->used) {
        st = oom(e, call, bytes);
        goto done;
    }
    if (charge == CHARGE_PINNED && (st = pin_room(e, call, bytes))) goto done;
    emu_alloc *a = calloc(1, sizeof *a);
    void *p = a ? map_aligned(e, bytes, e->page, PROT_READ | PROT_WRITE, charge == CHARGE_DEVICE ? MAP_NORESERVE : 0)
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
    if (charge == CHARGE_DEVICE) e->used += bytes;
    else if (charge == CHARGE_PINNED) e->pinned_host += bytes;
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
        if (charge == CHARGE_DEVICE) e->used -= a->bytes;
        else if (charge == CHARGE_PINNED) e->pinned_host -= a->bytes;
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
    return alloc_into(EMU(b), &EMU(b)->devs, bytes, CHARGE_DEVICE, "dev_alloc", out);
}

static spw_status emu_dev_free(spw_backend *b, void *ptr) {
    ENTER(EMU(b), DEV_FREE);
    return free_from(EMU(b), &EMU(b)->devs, ptr, CHARGE_DEVICE, "dev_free", "dev_alloc");
}

static spw_status emu_host_alloc(spw_backend *b, size_t bytes, void **out) {
    ENTER(EMU(b), HOST_ALLOC);
    return alloc_into(EMU(b), &EMU(b)->hosts, bytes, CHARGE_PINNED, "host_alloc", out);
}

static spw_status emu_host_free(spw_backend *b, void *ptr) {
    ENTER(EMU(b), HOST_FREE);
    return free_from(EMU(b), &EMU(b)->hosts, ptr, CHARGE_PINNED, "host_free", "host_alloc");
}

static spw_status emu_managed_alloc(spw_backend *b, size_t bytes, void **out) {
    ENTER(EMU(b), MANAGED_ALLOC);
    return alloc_into(EMU(b), &EMU(b)->manageds, bytes, CHARGE_DEVICE, "managed_alloc", out);
}

static spw_status emu_managed_free(spw_backend *b, void *ptr) {
    ENTER(EMU(b), DEV_FREE);
    return free_from(EMU(b), &EMU(b)->manageds, ptr, CHARGE_DEVICE, "managed_free", "managed_alloc");
}

/* The entry of `table` that contains [p, p+bytes) (inside=1) or overlaps it (inside=0), or
 * NULL. mem_lock held. */
emu_alloc *spw__emu_find_range(emu_alloc *table, const void *p, size_t bytes, int inside) {
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
    emu_alloc *a = spw__emu_find_range(e->regs, ptr, bytes, 0);
    if (!a) a = spw__emu_find_range(e->hosts, ptr, bytes, 0);
    if (a) {
        st = spw__error(SPW_ERR_STATE,
                        "emu: host_register(%p, %zu): overlaps pinned range %p (%zu bytes)", ptr,
                        bytes, a->ptr, a->bytes);
    } else if (!(st = pin_room(e, "host_register", bytes)) && (a = calloc(1, sizeof *a)) != NULL) {
        a->ptr = ptr;
        a->bytes = bytes;
        HASH_ADD_PTR(e->regs, ptr, a);
    }
    if (st == SPW_OK && (!a || hash_oom_)) {
        free(a);
        st = spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: host_register: out of memory");
    } else if (st == SPW_OK) {
        e->pinned_host += bytes;
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
    if (a) {
        HASH_DEL(e->regs, a);
        e->pinned_host -= a->bytes;
    }
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
    emu_alloc *a = spw__emu_find_range(e->manageds, ptr, bytes, 1);
    if (a) a->advice |= 1u << adv;
    pthread_mutex_unlock(&e->mem_lock);
    if (!a)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: managed_advise(%p, %zu): not inside a managed allocation", ptr,
                          bytes);
    return SPW_OK;
}

/* ---- virtual memory ---- */

/* bytes must be a positive multiple of the page; the address is page-aligned. */
static spw_status emu_va_reserve(spw_backend *b, size_t bytes, size_t page, void **va) {
    emu_backend *e = EMU(b);
    ENTER(e, VA_RESERVE);
    size_t pg = page ? page : e->gran;
    if (!va || !bytes || pg % e->gran || (pg & (pg - 1)) || bytes % pg)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: va_reserve(bytes=%zu, page=%zu, out=%p): need an out pointer, a "
                          "page that is a power-of-two multiple of the granularity %zu and a "
                          "positive multiple of the page",
                          bytes, page, (void *)va, e->gran);
    size_t pages = bytes / pg;
    emu_resv *r = calloc(1, sizeof *r);
    uint64_t *bits = calloc((pages + 63) / 64, sizeof *bits);
    char *p = r && bits ? map_aligned(e, bytes, pg, PROT_NONE, MAP_NORESERVE) : NULL;
    if (!p) {
        int err = errno;
        free(r);
        free(bits);
        return spw__error(SPW_ERR_OUT_OF_MEMORY, "emu: va_reserve of %zu bytes failed: %s",
                          bytes, strerror(err));
    }
    *r = (emu_resv){.va = p, .bytes = bytes, .page = pg, .bits = bits};
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
                        va, bytes, r->mapped * r->page);
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

/* Validate a map/unmap range, find its reservation, and check that its pages are all mapped
 * (want_set=1) or all unmapped. mem_lock held. */
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
    if (lo % r->page || bytes % r->page)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: %s(%p, %zu): address and size must be multiples of the "
                          "reservation's page %zu",
                          call, va, bytes, r->page);
    size_t bad = 0;
    *first = (lo - (uintptr_t)r->va) / r->page;
    if (!bits_all(r->bits, *first, bytes / r->page, want_set, &bad))
        return spw__error(SPW_ERR_STATE, "emu: %s(%p, %zu): the page at %p is %s", call, va,
                          bytes, (void *)(r->va + bad * r->page),
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
        bits_put(r->bits, first, bytes / r->page, 1);
        r->mapped += bytes / r->page;
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
        bits_put(r->bits, first, bytes / r->page, 0);
        r->mapped -= bytes / r->page;
        e->used -= bytes;
    }
    pthread_mutex_unlock(&e->mem_lock);
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
        spw__emu_stream_stop(e, s);
    }
    if (e->def) spw__emu_stream_stop(e, e->def);
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
    .prefetch = spw__emu_prefetch,
    .stream_create = spw__emu_stream_create,
    .stream_destroy = spw__emu_stream_destroy,
    .stream_sync = spw__emu_stream_sync,
    .event_create = spw__emu_event_create,
    .event_destroy = spw__emu_event_destroy,
    .event_record = spw__emu_event_record,
    .event_query = spw__emu_event_query,
    .event_sync = spw__emu_event_sync,
    .stream_wait = spw__emu_stream_wait,
    .memcpy_async = spw__emu_memcpy_async,
    .launch_host = spw__emu_launch_host,
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
    e->pin_limit = p->emu_pin_limit;
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
    spw_status st = spw__emu_stream_start(e, &e->def);
    if (st != SPW_OK) {
        emu_destroy(&e->base);
        return st;
    }
    *out = &e->base;
    return SPW_OK;
}
