/*
 * The cuda backend's virtual memory: reservations, and pages mapped and unmapped through the
 * driver's VMM entry points (resolved at run time in backend_cuda.c). Each reservation has its
 * page size (the granularity or a power-of-two multiple). map creates one physical allocation
 * per page and maps each separately, so that unmap may take back any page-aligned subrange of
 * mapped memory (cuMemUnmap cannot split a mapping). Per reservation, an array indexed by page
 * holds the handles.
 */
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"

static CUmemAllocationProp pinned_prop(const cuda_backend *c) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)c->cudev;
    return prop;
}

/* Decide whether VMM is usable: the device says so, every entry point resolved, and the
 * recommended granularity is a sane power of two. Any failure here just turns VMM off. */
void spw__cuda_probe_vmm(cuda_backend *c) {
    c->vmm_supported = 0;
    c->granularity = 0;
    if (!c->cu.vmm_ok) return;
    if (c->cu.device_get(&c->cudev, c->base.device) != CUDA_SUCCESS) return;
    int attr = 0;
    if (c->cu.device_get_attribute(&attr, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   c->cudev) != CUDA_SUCCESS || !attr)
        return;
    CUmemAllocationProp prop = pinned_prop(c);
    size_t g = 0;
    if (c->cu.get_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS)
        return;
    if (g == 0 || (g & (g - 1)) != 0) return;
    c->granularity = g;
    c->vmm_supported = 1;
}

/* ---- virtual memory ---- */

/* The reservation containing [addr, addr + bytes), or NULL. Called with c->lock held. */
static cuda_resv *find_resv(cuda_backend *c, uintptr_t addr, size_t bytes) {
    for (cuda_resv *r = c->resv; r; r = r->next)
        if (addr >= r->base && addr - r->base < r->bytes && bytes <= r->bytes - (addr - r->base))
            return r;
    return NULL;
}

static void free_resv(cuda_resv *r) {
    if (!r) return;
    free(r->handles);
    free(r->mapped);
    free(r);
}

static spw_status vmm_unsupported(const cuda_backend *c, const char *op) {
    return spw__error(SPW_ERR_UNSUPPORTED, "cuda: %s: virtual memory management unavailable on "
                      "device %d (device attribute or driver entry points missing)",
                      op, c->base.device);
}

spw_status spw__cuda_va_reserve(spw_backend *b, size_t bytes, size_t page, void **va) {
    cuda_backend *c = as_cuda(b);
    if (!c->vmm_supported) return vmm_unsupported(c, "va_reserve");
    size_t g = page ? page : c->granularity;
    if (g % c->granularity || (g & (g - 1)))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "cuda: va_reserve(%zu B, page %zu B): the page must be a power-of-two "
                          "multiple of the granularity %zu B",
                          bytes, page, c->granularity);
    if (!va || bytes == 0 || bytes > SIZE_MAX - g)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: va_reserve(%zu B): bad size or NULL out",
                          bytes);
    BIND(c);
    size_t rounded = SPW_ALIGN_UP(bytes, g);
    cuda_resv *r = calloc(1, sizeof *r);
    size_t n = rounded / g;
    if (r) {
        r->handles = calloc(n, sizeof *r->handles);
        r->mapped = calloc(n, 1);
    }
    if (!r || !r->handles || !r->mapped) {
        free_resv(r);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                          "cuda: va_reserve(%zu B): no host memory for %zu page records", bytes, n);
    }
    CUdeviceptr p = 0;
    CUresult res = c->cu.address_reserve(&p, rounded, g, 0, 0);
    if (res != CUDA_SUCCESS) {
        free_resv(r);
        return spw__cuda_cu_fail(c, spw__cuda_cu_status(res), res,
                                 "cuMemAddressReserve(%zu B, align %zu B)", rounded, g);
    }
    r->base = (uintptr_t)p;
    r->bytes = rounded;
    r->page = g;
    r->pages = n;
    pthread_mutex_lock(&c->lock);
    r->next = c->resv;
    c->resv = r;
    pthread_mutex_unlock(&c->lock);
    *va = (void *)r->base;
    return SPW_OK;
}

/* Unmap and release pages [first, first + count) of r, all mapped. Returns the first error;
 * pages whose unmap failed stay recorded as mapped. Called with c->lock held. */
static spw_status unmap_pages(cuda_backend *c, cuda_resv *r, size_t first, size_t count) {
    spw_status st = SPW_OK;
    size_t g = r->page;
    for (size_t i = first; i < first + count; i++) {
        CUdeviceptr addr = (CUdeviceptr)(r->base + i * g);
        CUresult res = c->cu.unmap(addr, g);
        if (res != CUDA_SUCCESS) {
            if (st == SPW_OK)
                st = spw__cuda_cu_fail(c, SPW_ERR_BACKEND, res, "cuMemUnmap(0x%llx, %zu B)",
                                       (unsigned long long)addr, g);
            continue;
        }
        r->mapped[i] = 0;
        r->mapped_count--;
        res = c->cu.release(r->handles[i]);
        r->handles[i] = 0;
        if (res != CUDA_SUCCESS && st == SPW_OK)
            st = spw__cuda_cu_fail(c, SPW_ERR_BACKEND, res, "cuMemRelease(page at 0x%llx)",
                                   (unsigned long long)addr);
    }
    return st;
}

/* Check that [va, va + bytes) is inside one reservation and aligned to its page; sets *r,
 * *first, *count (in pages). Called with c->lock held. */
static spw_status locate(cuda_backend *c, const char *op, void *va, size_t bytes, cuda_resv **r,
                         size_t *first, size_t *count) {
    uintptr_t a = (uintptr_t)va;
    size_t g = c->granularity;
    *r = NULL;
    if (va && bytes && a % g == 0 && bytes % g == 0) {
        if (!(*r = find_resv(c, a, bytes)))
            return spw__error(SPW_ERR_NOT_FOUND, "cuda: %s(%p, %zu B): not inside one reservation",
                              op, va, bytes);
        g = (*r)->page;
    }
    if (!*r || a % g != 0 || bytes % g != 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "cuda: %s(%p, %zu B): address and size must be non-zero multiples of "
                          "the page %zu B",
                          op, va, bytes, g);
    *first = (a - (*r)->base) / g;
    *count = bytes / g;
    return SPW_OK;
}

spw_status spw__cuda_map(spw_backend *b, void *va, size_t bytes) {
    cuda_backend *c = as_cuda(b);
    if (!c->vmm_supported) return vmm_unsupported(c, "map");
    BIND(c);
    pthread_mutex_lock(&c->lock);
    cuda_resv *r = NULL;
    size_t first = 0, count = 0;
    spw_status st = locate(c, "map", va, bytes, &r, &first, &count);
    size_t g = r ? r->page : c->granularity;
    for (size_t i = first; st == SPW_OK && i < first + count; i++)
        if (r->mapped[i])
            st = spw__error(SPW_ERR_STATE, "cuda: map(%p, %zu B): page at %p is already mapped",
                            va, bytes, (void *)(r->base + i * g));
    if (st != SPW_OK) {
        pthread_mutex_unlock(&c->lock);
        return st;
    }
    CUmemAllocationProp prop = pinned_prop(c);
    size_t done = 0;
    for (; done < count; done++) {
        size_t i = first + done;
        CUdeviceptr addr = (CUdeviceptr)(r->base + i * g);
        CUmemGenericAllocationHandle h = 0;
        CUresult res = c->cu.create(&h, g, &prop, 0);
        if (res != CUDA_SUCCESS) {
            st = spw__cuda_cu_fail(c, spw__cuda_cu_status(res), res,
                                   "cuMemCreate(%zu B) for page %zu of %zu in map(%p, %zu B)", g,
                                   done + 1, count, va, bytes);
            break;
        }
        res = c->cu.map(addr, g, 0, h, 0);
        if (res != CUDA_SUCCESS) {
            (void)c->cu.release(h);
            st = spw__cuda_cu_fail(c, spw__cuda_cu_status(res), res,
                                   "cuMemMap(0x%llx, %zu B) in map(%p, %zu B)",
                                   (unsigned long long)addr, g, va, bytes);
            break;
        }
        r->handles[i] = h;
        r->mapped[i] = 1;
        r->mapped_count++;
    }
    if (st == SPW_OK) {
        CUmemAccessDesc acc;
        memset(&acc, 0, sizeof acc);
        acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc.location.id = (int)c->cudev;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        CUresult res = c->cu.set_access((CUdeviceptr)(uintptr_t)va, bytes, &acc, 1);
        if (res != CUDA_SUCCESS)
            st = spw__cuda_cu_fail(c, spw__cuda_cu_status(res), res,
                                   "cuMemSetAccess(%p, %zu B, read/write)", va, bytes);
    }
    if (st != SPW_OK && done > 0) {
        /* A failed map maps nothing: take back what this call created. The first error's
         * message is the one reported. */
        char keep[1024];
        snprintf(keep, sizeof keep, "%s", spw_last_error());
        (void)unmap_pages(c, r, first, done);
        spw__error(st, "%s", keep);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Any page-aligned subrange of mapped memory, even one spanning several maps. Nothing is
 * unmapped unless every page in the range is mapped. The caller must have ordered all device
 * work using the range before this call (cuMemUnmap does not wait for it). */
spw_status spw__cuda_unmap(spw_backend *b, void *va, size_t bytes) {
    cuda_backend *c = as_cuda(b);
    if (!c->vmm_supported) return vmm_unsupported(c, "unmap");
    BIND(c);
    pthread_mutex_lock(&c->lock);
    cuda_resv *r = NULL;
    size_t first = 0, count = 0;
    spw_status st = locate(c, "unmap", va, bytes, &r, &first, &count);
    for (size_t i = first; st == SPW_OK && i < first + count; i++)
        if (!r->mapped[i])
            st = spw__error(SPW_ERR_STATE, "cuda: unmap(%p, %zu B): page at %p is not mapped",
                            va, bytes, (void *)(r->base + i * r->page));
    if (st == SPW_OK) st = unmap_pages(c, r, first, count);
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* va and bytes as given to (or returned by) va_reserve; every page must be unmapped. */
spw_status spw__cuda_va_release(spw_backend *b, void *va, size_t bytes) {
    cuda_backend *c = as_cuda(b);
    if (!c->vmm_supported) return vmm_unsupported(c, "va_release");
    BIND(c);
    pthread_mutex_lock(&c->lock);
    cuda_resv **pp = &c->resv;
    while (*pp && (*pp)->base != (uintptr_t)va) pp = &(*pp)->next;
    cuda_resv *r = *pp;
    size_t g = r ? r->page : c->granularity;
    spw_status st = SPW_OK;
    if (!r)
        st = spw__error(SPW_ERR_NOT_FOUND, "cuda: va_release(%p, %zu B): no reservation at %p", va,
                        bytes, va);
    else if (bytes > SIZE_MAX - g || SPW_ALIGN_UP(bytes, g) != r->bytes)
        st = spw__error(SPW_ERR_INVALID_ARGUMENT,
                        "cuda: va_release(%p, %zu B): the reservation is %zu B", va, bytes,
                        r->bytes);
    else if (r->mapped_count > 0)
        st = spw__error(SPW_ERR_STATE,
                        "cuda: va_release(%p, %zu B): %zu page(s) of %zu B still mapped", va,
                        bytes, r->mapped_count, g);
    if (st == SPW_OK) {
        CUresult res = c->cu.address_free((CUdeviceptr)r->base, r->bytes);
        if (res != CUDA_SUCCESS) {
            st = spw__cuda_cu_fail(c, SPW_ERR_BACKEND, res, "cuMemAddressFree(%p, %zu B)", va,
                                   r->bytes);
        } else {
            *pp = r->next;
            free_resv(r);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

void spw__cuda_vmm_release_all(cuda_backend *c) {
    pthread_mutex_lock(&c->lock);
    while (c->resv) {
        cuda_resv *r = c->resv;
        c->resv = r->next;
        for (size_t i = 0; i < r->pages; i++)
            if (r->mapped[i]) (void)unmap_pages(c, r, i, 1);
        (void)c->cu.address_free((CUdeviceptr)r->base, r->bytes);
        free_resv(r);
    }
    pthread_mutex_unlock(&c->lock);
}
