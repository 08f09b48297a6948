/*
 * Offline models of what an offload policy moves over a loaded access trace: the yardsticks that
 * `spillway simulate --compare` and the tests hold the engine to.
 *
 * Both models share one accounting, the one the engine's statistics use:
 * - Buffers start in host memory, not resident. Creating one moves nothing.
 * - An operation ('a') needs all its buffers resident at once. A buffer that is not resident is
 *   uploaded (h2d += bytes) when the operation reads it (r, rw); for w (old contents dead) it only
 *   takes room. Before that, victims are evicted until the missing buffers fit in the budget; the
 *   buffers of the operation itself are never victims.
 * - After the operation, buffers it wrote (w, rw) are dirty: the device copy is the only valid one.
 * - Evicting a dirty buffer writes it back (d2h += bytes) or drops it, depending on the model.
 *   Evicting a clean one drops it. Destroying a buffer ('f') drops it.
 * - Bytes count in the step of the operation that caused them.
 *
 * ORACLE (the floor in tests/data/README.md): on a miss, evict the resident buffer whose next
 * use is farthest away (never used again counts as farthest); write a dirty buffer back only if
 * its next access reads it (next access a w, or none: drop). Buffers whose next uses fall in the
 * same future operation are ordered by their position in that operation.
 * LRU (a plain least-recently-used cache, what policy=lru must not exceed): evict the buffer
 * whose last use is oldest (the buffers of one operation age in the order listed, which is the
 * order simulate releases them); write back every dirty buffer it evicts.
 *
 * ORACLE_REPEAT: the oracle, except that the future does not end with the trace: the last step is
 * assumed to run once more, as it would in a program that loops. At the end of a trace the plain
 * oracle drops every dirty buffer (no next use), which no online policy can know; this variant
 * removes that end effect and is the fairer floor for a policy that predicts the next step.
 *
 * Sizes are exact: the engine rounds device allocations (alignment, segments), so at the same
 * budget it may fit slightly fewer bytes than the models do.
 *
 * Cost: O(items x resident buffers) with linear victim scans; the traces hold hundreds of buffers.
 */
#include <stdlib.h>
#include <string.h>

#include "oracle.h"

#define NONE SIZE_MAX

typedef struct model_buf {
    bool resident, dirty, in_op;
    size_t next;        /* oracle: index in items[] of the next access, NONE if none */
    uint64_t last_use;  /* lru: clock of the last access */
} model_buf;

typedef struct model {
    const spw_access_trace *t;
    spw_access *vmode;  /* ORACLE_REPEAT: mode of virtual item nitems + k (k-th of the last step) */
    spw_model_kind kind;
    uint64_t budget, resident_bytes;
    model_buf *b;
    size_t *next_item;  /* per item: the next item of the same buffer, NONE if none */
    spw_model_result *r;
} model;

/* Index of the victim among resident buffers outside the current operation, or NONE. */
static size_t pick_victim(const model *m) {
    size_t best = NONE;
    for (size_t i = 0; i < m->t->nbufs; i++) {
        const model_buf *x = &m->b[i];
        if (!x->resident || x->in_op) continue;
        if (best == NONE) {
            best = i;
            continue;
        }
        const model_buf *y = &m->b[best];
        bool better = m->kind == SPW_MODEL_LRU ? x->last_use < y->last_use : x->next > y->next;
        if (better) best = i;
    }
    return best;
}

static void evict(model *m, size_t i, size_t step) {
    model_buf *x = &m->b[i];
    uint64_t bytes = m->t->bufs[i].bytes;
    bool write_back = x->dirty;
    if (m->kind != SPW_MODEL_LRU && x->next != NONE) {
        spw_access next = x->next < m->t->nitems ? m->t->items[x->next].mode
                                                 : m->vmode[x->next - m->t->nitems];
        write_back = x->dirty && next != SPW_ACCESS_WRITE;
    } else if (m->kind != SPW_MODEL_LRU) {
        write_back = false; /* never used again: dead */
    }
    if (write_back) {
        m->r->d2h[step] += bytes;
        m->r->bytes_d2h += bytes;
        m->r->evictions_dirty++;
    } else {
        m->r->evictions_clean++;
    }
    x->resident = false;
    x->dirty = false; /* written back, or dead: the host copy is the valid one (or none is) */
    m->resident_bytes -= bytes;
}

static spw_status run_access(model *m, const spw_access_op *op, uint64_t *clock) {
    const spw_access_trace *t = m->t;
    const spw_access_item *it = &t->items[op->first];
    uint64_t need = 0, all = 0;
    for (size_t k = 0; k < op->count; k++) {
        uint64_t bytes = t->bufs[it[k].buf].bytes;
        all += bytes;
        if (!m->b[it[k].buf].resident) need += bytes;
        m->b[it[k].buf].in_op = true;
    }
    spw_status st = SPW_OK;
    if (all > m->budget) {
        char b1[64], b2[64];
        st = spw__error(SPW_ERR_OUT_OF_MEMORY,
                        "line %zu: the operation's buffers (%s) exceed the budget (%s)", op->line,
                        spw__fmt_bytes(b1, sizeof b1, all), spw__fmt_bytes(b2, sizeof b2, m->budget));
        goto done;
    }
    while (m->budget - m->resident_bytes < need) {
        size_t v = pick_victim(m);
        if (v == NONE) { /* cannot happen: all <= budget and only this op is protected */
            st = spw__error(SPW_ERR_STATE, "line %zu: model found no victim", op->line);
            goto done;
        }
        evict(m, v, op->step);
    }
    for (size_t k = 0; k < op->count; k++) {
        model_buf *x = &m->b[it[k].buf];
        uint64_t bytes = t->bufs[it[k].buf].bytes;
        if (!x->resident) {
            if (it[k].mode != SPW_ACCESS_WRITE) {
                m->r->h2d[op->step] += bytes;
                m->r->bytes_h2d += bytes;
            }
            x->resident = true;
            m->resident_bytes += bytes;
        }
        if (it[k].mode != SPW_ACCESS_READ) x->dirty = true;
        x->next = m->next_item[op->first + k];
        x->last_use = ++*clock;
    }
done:
    for (size_t k = 0; k < op->count; k++) m->b[it[k].buf].in_op = false;
    return st;
}

/* ORACLE_REPEAT: chain each buffer's last access to a virtual repeat of the last step. Virtual
 * item nitems + k stands for the k-th access of the last step; a buffer alive at the end whose
 * chain ends is linked to its first access in that step. Called after the chains are built. */
static spw_status link_repeat(model *m) {
    const spw_access_trace *t = m->t;
    size_t start = t->nitems; /* first item of the last step */
    for (size_t i = t->nops; i-- > 0;) {
        const spw_access_op *op = &t->ops[i];
        if (op->kind == 'a' && t->nsteps && op->step == t->nsteps - 1) start = op->first;
        if (op->kind == 'a' && t->nsteps && op->step < t->nsteps - 1) break;
    }
    size_t n = t->nitems - start;
    m->vmode = malloc((n ? n : 1) * sizeof *m->vmode);
    size_t *vfirst = malloc((t->nbufs ? t->nbufs : 1) * sizeof *vfirst);
    bool *alive = malloc(t->nbufs ? t->nbufs : 1);
    if (!m->vmode || !vfirst || !alive) {
        free(vfirst);
        free(alive);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw__model_run: out of host memory");
    }
    for (size_t b = 0; b < t->nbufs; b++) {
        vfirst[b] = NONE;
        alive[b] = true;
    }
    for (size_t i = 0; i < t->nops; i++)
        if (t->ops[i].kind == 'f') alive[t->ops[i].buf] = false;
    for (size_t k = n; k-- > 0;) {
        m->vmode[k] = t->items[start + k].mode;
        vfirst[t->items[start + k].buf] = t->nitems + k;
    }
    for (size_t i = 0; i < t->nitems; i++) {
        uint32_t b = t->items[i].buf;
        if (m->next_item[i] == NONE && alive[b]) m->next_item[i] = vfirst[b];
    }
    free(vfirst);
    free(alive);
    return SPW_OK;
}

spw_status spw__model_run(const spw_access_trace *t, uint64_t budget, spw_model_kind kind,
                          spw_model_result *out) {
    if (!t || !out)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw__model_run: %s is NULL",
                          !t ? "trace" : "out");
    if (budget == 0) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw__model_run: budget is 0");
    if (kind != SPW_MODEL_ORACLE && kind != SPW_MODEL_ORACLE_REPEAT && kind != SPW_MODEL_LRU)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw__model_run: bad model %d", (int)kind);
    spw_model_result r = {.nsteps = t->nsteps};
    size_t ns = t->nsteps ? t->nsteps : 1;
    model m = {.t = t, .kind = kind, .budget = budget, .r = &r};
    r.h2d = calloc(ns, sizeof *r.h2d);
    r.d2h = calloc(ns, sizeof *r.d2h);
    m.b = calloc(t->nbufs ? t->nbufs : 1, sizeof *m.b);
    m.next_item = malloc((t->nitems ? t->nitems : 1) * sizeof *m.next_item);
    size_t *first = malloc((t->nbufs ? t->nbufs : 1) * sizeof *first);
    spw_status st = SPW_OK;
    if (!r.h2d || !r.d2h || !m.b || !m.next_item || !first) {
        st = spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw__model_run: out of host memory for %zu "
                        "buffers and %zu accesses", t->nbufs, t->nitems);
        goto out;
    }
    /* Next-use chains, built backwards: first[b] is b's earliest access not yet passed. */
    for (size_t i = 0; i < t->nbufs; i++) first[i] = NONE;
    for (size_t i = t->nitems; i-- > 0;) {
        m.next_item[i] = first[t->items[i].buf];
        first[t->items[i].buf] = i;
    }
    for (size_t i = 0; i < t->nbufs; i++) m.b[i].next = first[i];
    if (kind == SPW_MODEL_ORACLE_REPEAT && (st = link_repeat(&m)) != SPW_OK) goto out;

    uint64_t clock = 0;
    for (size_t i = 0; i < t->nops && st == SPW_OK; i++) {
        const spw_access_op *op = &t->ops[i];
        if (op->kind == 'a') {
            st = run_access(&m, op, &clock);
        } else if (op->kind == 'f' && m.b[op->buf].resident) {
            m.b[op->buf].resident = false; /* destroyed: dropped, never written back */
            m.b[op->buf].dirty = false;
            m.resident_bytes -= t->bufs[op->buf].bytes;
        }
    }
out:
    free(first);
    free(m.vmode);
    free(m.b);
    free(m.next_item);
    if (st != SPW_OK) {
        spw__model_free(&r);
        return st;
    }
    *out = r;
    return SPW_OK;
}

void spw__model_free(spw_model_result *r) {
    if (!r) return;
    free(r->h2d);
    free(r->d2h);
    memset(r, 0, sizeof *r);
}

uint64_t spw__model_moved_from(const spw_model_result *r, size_t from) {
    uint64_t sum = 0;
    for (size_t s = from; r && s < r->nsteps; s++) sum += r->h2d[s] + r->d2h[s];
    return sum;
}
