/*
 * LRU: evict the resident, unpinned buffer whose last release (or arrival, for a prefetch) is
 * oldest. One intrusive list through the buffers' policy nodes, oldest at the head; a buffer is
 * on the list exactly while it is resident and not acquired. O(1) per event; choose_victim skips
 * (rarely) buffers that are listed but not evictable at the moment (being destroyed).
 */
#include <stdlib.h>

#include "policy.h"

struct spw_policy {
    spw_policy_node head; /* sentinel: head.next oldest, head.prev newest */
    uint64_t clock;
};

static void unlink_node(spw_policy_node *n) {
    if (!n->listed) return;
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = NULL;
    n->listed = 0;
}

static void push_newest(spw_policy *p, spw_policy_node *n) {
    unlink_node(n);
    n->prev = p->head.prev;
    n->next = &p->head;
    p->head.prev->next = n;
    p->head.prev = n;
    n->listed = 1;
    n->stamp = ++p->clock;
}

static spw_status lru_create(spw_ctx *ctx, spw_policy **out) {
    (void)ctx;
    spw_policy *p = calloc(1, sizeof *p);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "policy lru: out of host memory");
    p->head.prev = p->head.next = &p->head;
    *out = p;
    return SPW_OK;
}

static void lru_destroy(spw_policy *p) { free(p); }

static void lru_on_destroy(spw_policy *p, spw_buf *b) {
    (void)p;
    unlink_node(spw__pol_node(b));
}

static void lru_on_acquire(spw_policy *p, spw_buf *b, spw_access mode, spw_stream s, unsigned count) {
    (void)p, (void)mode, (void)s, (void)count;
    unlink_node(spw__pol_node(b)); /* pinned: not a candidate */
}

static void lru_on_release(spw_policy *p, spw_buf *b, spw_stream s, unsigned count) {
    (void)s;
    if (count == 0 && spw__pol_resident(b)) push_newest(p, spw__pol_node(b));
}

static void lru_on_resident(spw_policy *p, spw_buf *b) {
    if (!spw__pol_acquired(b)) push_newest(p, spw__pol_node(b));
}

static void lru_on_evicted(spw_policy *p, spw_buf *b) {
    (void)p;
    unlink_node(spw__pol_node(b));
}

static spw_buf *lru_choose_victim(spw_policy *p, size_t need, spw_buf *incoming, int for_prefetch) {
    (void)need, (void)incoming, (void)for_prefetch;
    /* LRU never prefetches on its own: a prefetch here is the caller's hint (spw_prefetch),
     * which knows the future better than recency does, so it may displace the oldest. */
    for (spw_policy_node *n = p->head.next; n != &p->head; n = n->next)
        if (spw__pol_evictable(n->buf)) return n->buf;
    return NULL;
}

static uint64_t lru_rank_victim(spw_policy *p, spw_buf *b, spw_buf *incoming, int for_prefetch) {
    (void)incoming, (void)for_prefetch;
    spw_policy_node *n = spw__pol_node(b);
    return n->listed && spw__pol_evictable(b) ? p->clock - n->stamp + 1 : 0; /* older ranks higher */
}

const spw_policy_ops spw__policy_lru = {
    .name = "lru",
    .create = lru_create,
    .destroy = lru_destroy,
    .on_destroy = lru_on_destroy,
    .on_acquire = lru_on_acquire,
    .on_release = lru_on_release,
    .on_resident = lru_on_resident,
    .on_evicted = lru_on_evicted,
    .choose_victim = lru_choose_victim,
    .rank_victim = lru_rank_victim,
};
