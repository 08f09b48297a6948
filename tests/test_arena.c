/* The arena's decisions on small hand-checked cases: best fit, split, coalesce, trimming, segment
 * mode, and stream-ordered reuse. */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

#define MiB ((size_t)1 << 20)

static spw_ctx *emu_ctx(const char *conf) {
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_parse(cfg, "backend=emu,budget=256MiB,grow_ahead=0,emu_capacity=1GiB"));
    if (conf) assert_ok(spw_config_parse(cfg, conf));
    spw_ctx *ctx;
    assert_ok(spw_ctx_create(cfg, &ctx));
    spw_config_destroy(cfg);
    return ctx;
}

static void check(spw_ctx *ctx) {
    assert_ok(spw__arena_check(ctx->small));
    assert_ok(spw__arena_check(ctx->large));
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_true((size_t)st.held.current == spw__arena_held(ctx->small) + spw__arena_held(ctx->large));
    assert_true((size_t)st.held.current <= ctx->budget);
    assert_int_equal(st.cached.current, st.held.current - st.live.current);
    assert_int_equal(spw__emu_used(ctx->backend), (size_t)st.held.current);
}

typedef struct walk_count {
    int holes, frees, lives;
} walk_count;

static void count_cb(void *u, uintptr_t addr, size_t size, int state) {
    (void)addr;
    (void)size;
    walk_count *c = u;
    if (state == 0) c->holes++;
    else if (state == 1) c->frees++;
    else c->lives++;
}

/* Two 4 MiB blocks are adjacent; a 2 MiB request after freeing the first reuses its address
 * (split), the second 2 MiB request takes the rest, and freeing all coalesces into one block. */
static void split_and_coalesce(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx(NULL);
    char *a, *b, *c, *d;
    assert_ok(spw_malloc(ctx, 4 * MiB, NULL, (void **)&a));
    assert_ok(spw_malloc(ctx, 4 * MiB, NULL, (void **)&b));
    assert_ptr_equal(b, a + 4 * MiB);
    assert_ok(spw_free(ctx, a, NULL));
    assert_ok(spw_malloc(ctx, 2 * MiB, NULL, (void **)&c));
    assert_ptr_equal(c, a);
    assert_ok(spw_malloc(ctx, 2 * MiB, NULL, (void **)&d));
    assert_ptr_equal(d, a + 2 * MiB);
    check(ctx);
    assert_ok(spw_free(ctx, c, NULL));
    assert_ok(spw_free(ctx, b, NULL));
    assert_ok(spw_free(ctx, d, NULL));
    walk_count wc = {0};
    spw__arena_walk(ctx->large, count_cb, &wc);
    assert_int_equal(wc.lives, 0);
    assert_int_equal(wc.frees, 1); /* everything coalesced */
    check(ctx);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.live.current, 0);
    assert_int_equal(st.largest_free_block, 8 * MiB);
    spw_ctx_destroy(ctx);
}

/* Best fit: with free holes of 6 MiB and 3 MiB, a 3 MiB request takes the 3 MiB one. */
static void best_fit(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx(NULL);
    char *p[5];
    size_t sizes[5] = {6 * MiB, 2 * MiB, 3 * MiB, 2 * MiB, 6 * MiB};
    for (int i = 0; i < 5; i++) assert_ok(spw_malloc(ctx, sizes[i], NULL, (void **)&p[i]));
    assert_ok(spw_free(ctx, p[0], NULL));
    assert_ok(spw_free(ctx, p[2], NULL));
    char *q;
    assert_ok(spw_malloc(ctx, 3 * MiB, NULL, (void **)&q));
    assert_ptr_equal(q, p[2]);
    char *r;
    assert_ok(spw_malloc(ctx, 5 * MiB, NULL, (void **)&r));
    assert_ptr_equal(r, p[0]);
    check(ctx);
    spw_ctx_destroy(ctx);
}

/* Rounding: sizes are rounded to 512 B, live bytes count the rounded size, requested the raw. */
static void rounding(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx(NULL);
    void *a, *b;
    assert_ok(spw_malloc(ctx, 1, NULL, &a));
    assert_ok(spw_malloc(ctx, 513, NULL, &b));
    assert_int_equal((uintptr_t)a % 512, 0);
    assert_int_equal((uintptr_t)b % 512, 0);
    assert_int_equal((char *)b - (char *)a, 512);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.live.current, 512 + 1024);
    assert_int_equal(st.requested.current, 1 + 513);
    assert_ok(spw_free(ctx, a, NULL));
    assert_ok(spw_free(ctx, b, NULL));
    check(ctx);
    spw_ctx_destroy(ctx);
}

/* empty_cache returns every page; held and the emulated device usage drop to zero, and the
 * arena grows again in place afterwards. */
static void trim_all(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx(NULL);
    void *p[8];
    for (int i = 0; i < 8; i++) assert_ok(spw_malloc(ctx, (size_t)(i + 1) * 3 * MiB, NULL, &p[i]));
    for (int i = 0; i < 8; i += 2) assert_ok(spw_free(ctx, p[i], NULL));
    check(ctx);
    assert_ok(spw_empty_cache(ctx));
    check(ctx);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    /* only pages touched by live blocks remain */
    assert_true(st.held.current >= st.live.current);
    assert_true(st.held.current <= st.live.current + 8 * 2 * (int64_t)MiB);
    for (int i = 1; i < 8; i += 2) assert_ok(spw_free(ctx, p[i], NULL));
    assert_ok(spw_empty_cache(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 0);
    assert_int_equal(spw__emu_used(ctx->backend), 0);
    walk_count wc = {0};
    spw__arena_walk(ctx->large, count_cb, &wc);
    assert_int_equal(wc.holes, 1);
    assert_int_equal(wc.frees + wc.lives, 0);
    assert_ok(spw_malloc(ctx, 5 * MiB, NULL, &p[0]));
    check(ctx);
    assert_ok(spw_free(ctx, p[0], NULL));
    spw_ctx_destroy(ctx);
}

/* Held bytes track live bytes: a cached hole that cannot serve a larger request is returned
 * before new pages are mapped, so held stays within the slack of live. */
static void held_tracks_live(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx("frag_slack=0");
    void *big, *pin;
    assert_ok(spw_malloc(ctx, 64 * MiB, NULL, &big));
    assert_ok(spw_malloc(ctx, 2 * MiB, NULL, &pin));
    assert_ok(spw_free(ctx, big, NULL)); /* 64 MiB cached below a live block */
    void *bigger;
    assert_ok(spw_malloc(ctx, 96 * MiB, NULL, &bigger));
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.live.current, 98 * MiB);
    assert_true(st.held.current <= st.live.current + 4 * (int64_t)MiB);
    check(ctx);
    spw_free(ctx, bigger, NULL);
    spw_free(ctx, pin, NULL);
    spw_ctx_destroy(ctx);
}

/* vmm_large_page: the large-block arena maps and trims in whole large pages (one physical
 * allocation each, so a copy over a large buffer is split fewer times); small blocks keep the
 * granularity. The budget counts the pages mapped. */
static void large_pages(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx("vmm_large_page=24MiB"); /* rounded up to 32 MiB */
    char *a, *b, *s;
    assert_ok(spw_malloc(ctx, 40 * MiB, NULL, (void **)&a));
    assert_int_equal((uintptr_t)a % (32 * MiB), 0);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 64 * MiB);
    assert_ok(spw_malloc(ctx, 4096, NULL, (void **)&s)); /* small arena: 2 MiB pages */
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 66 * MiB);
    assert_ok(spw_malloc(ctx, 20 * MiB, NULL, (void **)&b)); /* fits in the mapped tail */
    assert_ptr_equal(b, a + 40 * MiB);
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 66 * MiB);
    check(ctx);
    /* freeing a leaves [0, 40) MiB free; only the whole page [0, 32) can go back */
    assert_ok(spw_free(ctx, a, NULL));
    assert_ok(spw_empty_cache(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 34 * MiB);
    check(ctx);
    assert_ok(spw_free(ctx, b, NULL));
    assert_ok(spw_free(ctx, s, NULL));
    assert_ok(spw_empty_cache(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 0);
    check(ctx);
    spw_ctx_destroy(ctx);
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_parse(cfg, "backend=emu,vmm_large_page=2GiB"));
    spw_ctx *bad = NULL;
    assert_status(spw_ctx_create(cfg, &bad), SPW_ERR_CONFIG);
    assert_non_null(strstr(spw_last_error(), "vmm_large_page"));
    spw_config_destroy(cfg);
}

/* Without VMM, memory comes in segments that are returned whole when entirely free. */
static void segment_mode(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx("vmm=off");
    void *a, *b, *c;
    assert_ok(spw_malloc(ctx, 10 * MiB, NULL, &a));
    assert_ok(spw_malloc(ctx, 4096, NULL, &b));
    assert_ok(spw_malloc(ctx, 4096, NULL, &c));
    assert_int_equal((char *)c - (char *)b, 4096); /* small requests share a 2 MiB segment */
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 10 * MiB + 2 * MiB);
    assert_int_equal(st.segments.current, 2);
    assert_ok(spw_free(ctx, a, NULL));
    assert_ok(spw_free(ctx, b, NULL));
    assert_ok(spw_empty_cache(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 2 * MiB); /* c keeps its segment */
    assert_int_equal(st.segments.current, 1);
    check(ctx);
    assert_ok(spw_free(ctx, c, NULL));
    spw_ctx_destroy(ctx);
}

/* Segment mode, large blocks: a block is its whole segment. A smaller request does not split a
 * cached segment, a request of the same size reuses it, and since nothing shares a segment every
 * cached byte can be given back: the last request fits, where carving the small block out of the
 * cached 32 MiB would have pinned 24 MiB of it and refused the request. */
static void whole_segments(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx("vmm=off,budget=64MiB");
    char *a, *b, *c, *d;
    assert_ok(spw_malloc(ctx, 32 * MiB, NULL, (void **)&a));
    assert_ok(spw_free(ctx, a, NULL));
    assert_ok(spw_malloc(ctx, 8 * MiB, NULL, (void **)&b));
    assert_true(b < a || b >= a + 32 * MiB); /* not carved out of the cached segment */
    assert_ok(spw_malloc(ctx, 32 * MiB - 4096, NULL, (void **)&c));
    assert_ptr_equal(c, a); /* the same pages: the cached segment */
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 40 * MiB);
    assert_int_equal(st.segments.current, 2);
    check(ctx);
    assert_ok(spw_free(ctx, c, NULL));
    assert_ok(spw_malloc(ctx, 40 * MiB, NULL, (void **)&d)); /* 40 + 40 > 64: the cached 32 goes */
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current, 48 * MiB);
    assert_int_equal(st.cached.current, 0);
    check(ctx);
    assert_ok(spw_free(ctx, b, NULL));
    assert_ok(spw_free(ctx, d, NULL));
    spw_ctx_destroy(ctx);
}

/* A trim that can return nothing does not make the host wait: a small block's segment, partly
 * free, cannot be returned, so a large request past the budget fails (or an empty_cache ends)
 * without a synchronization of the streams. */
static void a_trim_that_frees_nothing_does_not_wait(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx("vmm=off,budget=64MiB");
    void *small[2], *big, *more;
    for (int i = 0; i < 2; i++) assert_ok(spw_malloc(ctx, 4096, NULL, &small[i]));
    assert_ok(spw_free(ctx, small[0], NULL)); /* its segment: one live block, one free */
    assert_ok(spw_malloc(ctx, 60 * MiB, NULL, &big));
    spw_stats st0, st;
    assert_ok(spw_stats_get(ctx, &st0));
    assert_status(spw_malloc(ctx, 8 * MiB, NULL, &more), SPW_ERR_OUT_OF_MEMORY);
    assert_ok(spw_empty_cache(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.trim_syncs.total, st0.trim_syncs.total);
    assert_int_equal(st.held.current, st0.held.current);
    /* once the segment is wholly free, the trim returns it (and waits for the streams once) */
    assert_ok(spw_free(ctx, small[1], NULL));
    assert_ok(spw_empty_cache(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.trim_syncs.total, st0.trim_syncs.total + 1);
    assert_int_equal(st.held.current, 60 * MiB);
    check(ctx);
    assert_ok(spw_free(ctx, big, NULL));
    spw_ctx_destroy(ctx);
}

/* The budget is hard: a request past it fails with the numbers, changes nothing, and succeeds
 * once cached memory is given back to it. */
static void budget_is_hard(void **state) {
    (void)state;
    spw_ctx *ctx = emu_ctx("budget=64MiB");
    void *a, *b;
    assert_ok(spw_malloc(ctx, 40 * MiB, NULL, &a));
    spw_stats before, after;
    assert_ok(spw_stats_get(ctx, &before));
    assert_status(spw_malloc(ctx, 40 * MiB, NULL, &b), SPW_ERR_OUT_OF_MEMORY);
    const char *msg = spw_last_error();
    assert_non_null(strstr(msg, "requested 40.00 MiB"));
    assert_non_null(strstr(msg, "budget 64.00 MiB"));
    assert_non_null(strstr(msg, "live 40.00 MiB"));
    assert_non_null(strstr(msg, "largest free block"));
    assert_ok(spw_stats_get(ctx, &after));
    assert_int_equal(after.held.current, before.held.current);
    assert_int_equal(after.live.current, before.live.current);
    assert_int_equal(after.ooms.total, before.ooms.total + 1);
    /* freeing a makes room: the cached 40 MiB is reused, not added */
    assert_ok(spw_free(ctx, a, NULL));
    assert_ok(spw_malloc(ctx, 60 * MiB, NULL, &b));
    check(ctx);
    assert_ok(spw_free(ctx, b, NULL));
    spw_ctx_destroy(ctx);
}

/* ---- stream order ---- */

typedef struct slow_writer {
    unsigned char *ptr;
    atomic_int done;
    atomic_int seen_done;
} slow_writer;

static void slow_write(void *arg) {
    slow_writer *w = arg;
    usleep(100 * 1000);
    memset(w->ptr, 0xAB, 4096);
    atomic_store(&w->done, 1);
}

static void observe(void *arg) {
    slow_writer *w = arg;
    atomic_store(&w->seen_done, atomic_load(&w->done) ? 1 : -1);
}

/* A block freed on stream A while A's work on it is still pending is reused on stream B: B's
 * later work must run only after A's work finished. Fails if the arena hands the block over
 * without ordering B after A. */
static void cross_stream_reuse_waits(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = emu_ctx(NULL);
    spw_stream sa, sb;
    assert_ok(spw_stream_create(ctx, &sa));
    assert_ok(spw_stream_create(ctx, &sb));
    slow_writer w = {0};
    assert_ok(spw_malloc(ctx, 8 * MiB, sa, (void **)&w.ptr));
    assert_ok(spw_launch_host(ctx, sa, slow_write, &w));
    assert_ok(spw_free(ctx, w.ptr, sa));
    void *q;
    assert_ok(spw_malloc(ctx, 8 * MiB, sb, &q));
    assert_ptr_equal(q, w.ptr); /* reused, not grown */
    assert_ok(spw_launch_host(ctx, sb, observe, &w));
    assert_ok(spw_stream_synchronize(ctx, sb));
    assert_int_equal(atomic_load(&w.seen_done), 1);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.cross_stream_waits.total, 1);
    assert_ok(spw_free(ctx, q, sb));
    /* same-stream reuse needs no event */
    assert_ok(spw_malloc(ctx, 8 * MiB, sb, &q));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.cross_stream_waits.total, 1);
    assert_ok(spw_free(ctx, q, sb));
    assert_ok(spw_stream_synchronize(ctx, sa));
    assert_ok(spw_stream_destroy(ctx, sa));
    assert_ok(spw_stream_destroy(ctx, sb));
    spw_ctx_destroy(ctx);
}

/* A block is reused on its own stream at once, with no backend call on that path. */
static void hot_path_no_backend_calls(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = emu_ctx(NULL);
    void *p;
    assert_ok(spw_malloc(ctx, 1 * MiB, NULL, &p));
    assert_ok(spw_free(ctx, p, NULL));
    unsigned long before[SPW_CALL_COUNT_];
    for (int k = 0; k < SPW_CALL_COUNT_; k++) before[k] = spw__emu_calls(ctx->backend, (spw_call)k);
    for (int i = 0; i < 1000; i++) {
        assert_ok(spw_malloc(ctx, 1 * MiB, NULL, &p));
        assert_ok(spw_free(ctx, p, NULL));
    }
    for (int k = 0; k < SPW_CALL_COUNT_; k++)
        assert_int_equal(spw__emu_calls(ctx->backend, (spw_call)k), before[k]);
    spw_ctx_destroy(ctx);
}

/* The run a window names: with blocks A B C D of 4 MiB adjacent and B free, 8 MiB can come from
 * {A, B} or {B, C} (or {C, D} with two victims); the one whose worst victim ranks highest wins,
 * a victim ranked 0 is never taken, and nothing fits when every candidate is 0. */
typedef struct ranks {
    uint64_t r[4];
    spw_block *blk[4];
} ranks;

static uint64_t rank_of(void *u, void *owner) {
    ranks *k = u;
    return k->r[(int)(intptr_t)owner - 1];
}

/* Blocks A-D of 4 MiB, adjacent in that order, owned by 1-4 (the index into k->r plus one). */
static void own_four_blocks(spw_ctx *ctx, ranks *k) {
    for (int i = 0; i < 4; i++) {
        assert_ok(spw__arena_alloc(ctx->large, 4 * MiB, NULL, &k->blk[i]));
        spw__block_set_owner(k->blk[i], (void *)(intptr_t)(i + 1));
    }
    for (int i = 1; i < 4; i++)
        assert_true(spw__block_ptr(k->blk[i]) == (char *)spw__block_ptr(k->blk[i - 1]) + 4 * MiB);
}

static void window_picks_the_best_run(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = emu_ctx("vmm=on");
    ranks k = {{5, 0, 9, 1}, {0}};
    own_four_blocks(ctx, &k);
    spw__arena_free(ctx->large, k.blk[1], NULL);
    void *v[4];
    assert_int_equal(spw__arena_window(ctx->large, 8 * MiB, NULL, rank_of, &k, v, 4), 1);
    assert_int_equal((intptr_t)v[0], 3); /* {B, C}: C ranks 9, above A's 5 */
    k.r[2] = 0;
    assert_int_equal(spw__arena_window(ctx->large, 8 * MiB, NULL, rank_of, &k, v, 4), 1);
    assert_int_equal((intptr_t)v[0], 1); /* C must stay: {A, B} */
    assert_int_equal(spw__arena_window(ctx->large, 12 * MiB, NULL, rank_of, &k, v, 4), 0); /* C splits every run */
    k.r[2] = 2;
    assert_int_equal(spw__arena_window(ctx->large, 12 * MiB, NULL, rank_of, &k, v, 1), 0); /* two victims at most one */
    assert_int_equal(spw__arena_window(ctx->large, 12 * MiB, NULL, rank_of, &k, v, 4), 2); /* {A, B, C}: worst 2 > {B, C, D}'s 1 */
    k.r[0] = k.r[2] = k.r[3] = 0;
    assert_int_equal(spw__arena_window(ctx->large, 8 * MiB, NULL, rank_of, &k, v, 4), 0);
    check(ctx);
    for (int i = 0; i < 4; i++)
        if (i != 1) spw__arena_free(ctx->large, k.blk[i], NULL);
    spw_ctx_destroy(ctx);
}

static void bytes_cb(void *u, uintptr_t addr, size_t size, int state) {
    (void)addr;
    ((size_t *)u)[state] += size;
}

/* accept() of the ring's scan: the rank as a verdict (0 step over, 1 take, 9 stop). */
static int accept_of(void *u, void *owner) {
    ranks *k = u;
    uint64_t r = k->r[(int)(intptr_t)owner - 1];
    return r == 9 ? -1 : (int)r;
}

/* A ring's next place: the first run from an address that holds the bytes, over cached blocks
 * and the blocks accept() takes, stepping over the ones it refuses, wrapping once; and the
 * allocation at a caller's address, only inside one cached block, the bytes around it staying
 * cached. */
static void next_run_and_alloc_at(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = emu_ctx("vmm=on");
    ranks k = {{1, 0, 1, 1}, {0}};
    own_four_blocks(ctx, &k);
    uintptr_t a0 = (uintptr_t)spw__block_ptr(k.blk[0]), at = 0;
    void *v[4];
    size_t n = 0;
    /* from A: {A} holds 4 MiB; 6 MiB needs B, which must stay: {C, D} from C */
    assert_int_equal(spw__arena_next_run(ctx->large, a0, 4 * MiB, NULL, accept_of, &k, v, 4, &n, &at), 1);
    assert_true(at == a0 && n == 1 && (intptr_t)v[0] == 1);
    assert_int_equal(spw__arena_next_run(ctx->large, a0, 6 * MiB, NULL, accept_of, &k, v, 4, &n, &at), 1);
    assert_true(at == a0 + 8 * MiB && n == 2 && (intptr_t)v[0] == 3 && (intptr_t)v[1] == 4);
    assert_int_equal(spw__arena_next_run(ctx->large, a0, 6 * MiB, NULL, accept_of, &k, v, 1, &n, &at), -2);
    /* from the middle of D: the run starts there; past D's end it wraps to A */
    assert_int_equal(spw__arena_next_run(ctx->large, a0 + 13 * MiB, 3 * MiB, NULL, accept_of, &k, v, 4, &n, &at), 1);
    assert_true(at == a0 + 13 * MiB && n == 1 && (intptr_t)v[0] == 4);
    assert_int_equal(spw__arena_next_run(ctx->large, a0 + 13 * MiB, 4 * MiB, NULL, accept_of, &k, v, 4, &n, &at), 1);
    assert_true(at == a0 && n == 1 && (intptr_t)v[0] == 1);
    /* from past every block: one pass from the first */
    assert_int_equal(spw__arena_next_run(ctx->large, UINTPTR_MAX - 4096, 4 * MiB, NULL, accept_of, &k, v, 4, &n, &at), 1);
    assert_true(at == a0 && n == 1 && (intptr_t)v[0] == 1);
    k.r[2] = 9; /* C is the ring's and not free yet: the scan stops there */
    assert_int_equal(spw__arena_next_run(ctx->large, a0, 6 * MiB, NULL, accept_of, &k, v, 4, &n, &at), -1);
    k.r[2] = 1;
    assert_int_equal(spw__arena_next_run(ctx->large, a0, 20 * MiB, NULL, accept_of, &k, v, 4, &n, &at), 0);
    /* C given up: 4 MiB cached at a0 + 8 MiB; alloc_at inside it only */
    spw__arena_free(ctx->large, k.blk[2], NULL);
    spw_block *b = NULL;
    spw_arena_wait w[SPW_ARENA_OWED_MAX];
    int nw = -1;
    size_t held = spw__arena_held(ctx->large);
    assert_int_equal(spw__arena_alloc_at(ctx->large, a0 + 7 * MiB, 2 * MiB, NULL, &b, w, &nw), SPW_ERR_OUT_OF_MEMORY);
    assert_int_equal(spw__arena_alloc_at(ctx->large, a0 + 11 * MiB, 2 * MiB, NULL, &b, w, &nw), SPW_ERR_OUT_OF_MEMORY);
    assert_int_equal(spw__arena_alloc_at(ctx->large, a0 + 9 * MiB + 1, MiB, NULL, &b, w, &nw), SPW_ERR_OUT_OF_MEMORY);
    assert_null(b);
    assert_ok(spw__arena_alloc_at(ctx->large, a0 + 9 * MiB, 2 * MiB, NULL, &b, w, &nw));
    assert_true((uintptr_t)spw__block_ptr(b) == a0 + 9 * MiB && spw__block_size(b) == 2 * MiB && nw == 0);
    assert_int_equal(spw__arena_held(ctx->large), held); /* nothing mapped or returned */
    check(ctx);
    size_t bytes[3] = {0};
    spw__arena_walk(ctx->large, bytes_cb, bytes);
    assert_int_equal(bytes[1], 2 * MiB); /* the cached bytes around it: 1 MiB each side */
    spw__arena_free(ctx->large, b, NULL);
    for (int i = 0; i < 4; i++)
        if (i != 2) spw__arena_free(ctx->large, k.blk[i], NULL);
    check(ctx);
    spw_ctx_destroy(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(split_and_coalesce), cmocka_unit_test(best_fit),
        cmocka_unit_test(rounding),           cmocka_unit_test(trim_all),
        cmocka_unit_test(held_tracks_live),   cmocka_unit_test(segment_mode),
        cmocka_unit_test(large_pages),        cmocka_unit_test(whole_segments),
        cmocka_unit_test(budget_is_hard),     cmocka_unit_test(a_trim_that_frees_nothing_does_not_wait),
        cmocka_unit_test(cross_stream_reuse_waits),
        cmocka_unit_test(hot_path_no_backend_calls), cmocka_unit_test(window_picks_the_best_run),
        cmocka_unit_test(next_run_and_alloc_at),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
