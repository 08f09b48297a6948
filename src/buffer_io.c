/*
 * The buffer API's host side: writing and reading a buffer's contents through its host copy,
 * and opening the host copy for direct writes. Each call blocks by contract (it waits for the
 * transfers into or out of the host copy); the context lock is dropped while it waits. States
 * and locking: buffer.c.
 */
#include <string.h>

#include "engine.h"

static spw_status check_range(const char *fn, const spw_buf *b, size_t off, const void *p, size_t n) {
    if (!p) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: host pointer is NULL", fn);
    if (!n) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: size 0", fn);
    if (off > b->bytes || n > b->bytes - off)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: range [%zu, %zu + %zu) is outside the buffer of %zu B", fn,
                          off, off, n, b->bytes);
    return SPW_OK;
}

SPW_API spw_status spw_buf_write(spw_buf *b, size_t off, const void *src, size_t n) {
    const char *fn = "spw_buf_write";
    spw_status st;
    if ((st = spw__buf_enter(b, fn))) return st;
    spw_ctx *ctx = b->ctx;
    if ((st = check_range(fn, b, off, src, n))) goto out;
    if (b->acq || b->host_busy) {
        st = spw__buf_in_use(fn, b);
        goto out;
    }
    /* a partial write into a dirty buffer needs the rest of the contents on the host first */
    bool whole = off == 0 && n == b->bytes;
    if (spw__pol_dirty(b) && !whole && (st = spw__copy_writeback(ctx, b))) goto out;
    spw_host_wait w;
    spw__copy_host_wait_collect(ctx, b, true, &w);
    b->host_busy = true; /* no upload reads the host copy while it is being filled */
    pthread_mutex_unlock(&ctx->lock);
    st = spw__copy_host_wait(ctx, &w);
    if (!st) memcpy((char *)b->host + off, src, n);
    pthread_mutex_lock(&ctx->lock);
    b->host_busy = false;
    if (st) goto out;
    spw__buf_host_written(b);
    if (!b->managed && b->resident) {
        /* bring the device copy up to date, or drop it (always safe: the host copy is whole) */
        if (!b->dv || spw__copy_upload_range(ctx, b, off, n)) {
            spw__res_drop_device(ctx, b);
        } else {
            b->dv = true;
            spw__pf_watch(ctx, b);
        }
    }
    spw__error_clear();
out:
    spw__buf_leave(b);
    return st;
}

SPW_API spw_status spw_buf_host_begin(spw_buf *b) {
    const char *fn = "spw_buf_host_begin";
    spw_status st;
    if ((st = spw__buf_enter(b, fn))) return st;
    spw_ctx *ctx = b->ctx;
    if (b->acq || b->host_busy) {
        st = spw__buf_in_use(fn, b);
        spw__buf_leave(b);
        return st;
    }
    /* the device copy is about to be stale: written back if dirty (managed: migrated), dropped */
    if (b->resident && (st = spw__res_evict_buf(ctx, b, true))) {
        spw__buf_leave(b);
        return spw__error_prefix(st, "%s: dropping the device copy of buffer #%llu", fn, (unsigned long long)b->id);
    }
    spw_host_wait w;
    spw__copy_host_wait_collect(ctx, b, true, &w);
    b->host_busy = true; /* from here no upload reads the host copy, no call writes it */
    b->host_open = true;
    pthread_mutex_unlock(&ctx->lock);
    st = spw__copy_host_wait(ctx, &w); /* a write-back into the host copy still in flight */
    if (st) {
        pthread_mutex_lock(&ctx->lock);
        b->host_busy = false;
        b->host_open = false;
        pthread_mutex_unlock(&ctx->lock);
        return spw__error_prefix(st, "%s: waiting for the transfers into buffer #%llu", fn, (unsigned long long)b->id);
    }
    return SPW_OK;
}

SPW_API spw_status spw_buf_host_end(spw_buf *b) {
    const char *fn = "spw_buf_host_end";
    spw_status st;
    if ((st = spw__buf_enter(b, fn))) return st;
    if (!b->host_open) {
        st = spw__error(SPW_ERR_STATE, "%s: buffer #%llu is not open for host writes (no spw_buf_host_begin)", fn,
                        (unsigned long long)b->id);
    } else {
        b->host_open = false;
        b->host_busy = false;
        spw__buf_host_written(b); /* the device copy was dropped at the begin */
    }
    spw__buf_leave(b);
    return st;
}

SPW_API spw_status spw_buf_read(spw_buf *b, size_t off, void *dst, size_t n) {
    const char *fn = "spw_buf_read";
    spw_status st;
    if ((st = spw__buf_enter(b, fn))) return st;
    spw_ctx *ctx = b->ctx;
    if ((st = check_range(fn, b, off, dst, n))) goto out;
    if (b->acq_writers || b->host_busy) {
        st = spw__error(SPW_ERR_STATE, "%s: buffer #%llu is %s", fn, (unsigned long long)b->id,
                        b->acq_writers ? "acquired for writing; release it first" : spw__buf_busy_why(b));
        goto out;
    }
    if (ctx->engine->pops->on_host_read) ctx->engine->pops->on_host_read(ctx->engine->pol, b);
    if (b->dead) {
        st = spw__error(SPW_ERR_STATE, "%s: the contents of buffer #%llu are dead: discarded by spw_discard, or "
                        "dropped by policy=plan because every learned step overwrote them before reading "
                        "them; write them first", fn, (unsigned long long)b->id);
        goto out;
    }
    /* dirty: copy back (the device copy stays, now clean) */
    if (spw__pol_dirty(b) && (st = spw__copy_writeback(ctx, b))) goto out;
    spw_host_wait w;
    spw__copy_host_wait_collect(ctx, b, true, &w);
    pthread_mutex_unlock(&ctx->lock);
    st = spw__copy_host_wait(ctx, &w);
    if (!st) memcpy(dst, (const char *)b->host + off, n);
    return st;
out:
    spw__buf_leave(b);
    return st;
}
