/* policy=plan on small hand-checked cases: the exact victims of the learned plan, divergence
 * and relearning, buffers created inside a step, dropped write-backs, and no data loss under
 * fault injection. emu only: the "kernels" are host callbacks touching device memory. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "policy_plan.h"
#include "test_util.h"

#define MiB ((size_t)1 << 20)
#define SZ (2 * MiB) /* page-sized buffers: the budget holds exactly BUDGET_BUFS of them */

/* budget for 3 buffers of SZ (plus change that holds no fourth) */
static spw_ctx *plan_ctx(void) {
    return test_ctx("budget=7MiB,policy=plan,grow_ahead=0,prefetch=off");
}


static void touch(spw_ctx *ctx, spw_buf *b, spw_access mode) {
    void *d;
    assert_ok(spw_acquire(b, NULL, mode, &d));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_stream_synchronize(ctx, NULL));
}

static void resident_is(spw_buf **b, const char *want) {
    for (int i = 0; want[i]; i++) {
        bool r = b[i]->resident;
        if ((want[i] == '1') != r) fail_msg("buffer %c: resident %d, want %c (pattern %s)", 'A' + i, r, want[i], want);
    }
}

/* Cyclic A B C D with room for three. Step 1 (recording) is LRU and leaves B C D. When the plan
 * is learned the policy moves to the set Belady holds at that boundary when started from an
 * empty device, A B D: one upload (A, displacing C, outside that set). From then on the victim
 * is the buffer used farthest in the future (never LRU's choice here) and every step moves one
 * buffer. Without the move, Belady from LRU's leftovers moves two in the next step. */
static void exact_victims(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = plan_ctx();
    spw_buf *b[4];
    for (int i = 0; i < 4; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
    assert_ok(spw_step_begin(ctx));
    for (int i = 0; i < 4; i++) touch(ctx, b[i], SPW_ACCESS_READ);
    resident_is(b, "0111"); /* LRU evicted A for D */
    int64_t h0 = test_stats(ctx).bytes_h2d.total;
    assert_ok(spw_step_begin(ctx));
    resident_is(b, "1101"); /* the start state: A in, C out */
    assert_int_equal(test_stats(ctx).bytes_h2d.total - h0, (int64_t)SZ);
    h0 = test_stats(ctx).bytes_h2d.total;
    touch(ctx, b[0], SPW_ACCESS_READ);
    touch(ctx, b[1], SPW_ACCESS_READ);
    resident_is(b, "1101");
    touch(ctx, b[2], SPW_ACCESS_READ);
    resident_is(b, "1011"); /* C in: B out (D is needed next, A next step before B) */
    touch(ctx, b[3], SPW_ACCESS_READ);
    assert_int_equal(test_stats(ctx).bytes_h2d.total - h0, (int64_t)SZ);
    assert_ok(spw_step_begin(ctx));
    h0 = test_stats(ctx).bytes_h2d.total;
    touch(ctx, b[0], SPW_ACCESS_READ);
    touch(ctx, b[1], SPW_ACCESS_READ);
    resident_is(b, "0111"); /* B in: A out (C and D come sooner) */
    touch(ctx, b[2], SPW_ACCESS_READ);
    touch(ctx, b[3], SPW_ACCESS_READ);
    assert_ok(spw_step_end(ctx));
    assert_int_equal(test_stats(ctx).bytes_h2d.total - h0, (int64_t)SZ); /* LRU: 4 per step */
    spw_stats st = test_stats(ctx);
    assert_int_equal(st.plan_divergences.total, 0);
    assert_int_equal(st.plan_hits.total, 8);
    spw_ctx_destroy(ctx);
}

/* A dirty buffer whose next access overwrites it is dropped, not written back; the reads in
 * between still see the data (checked on the device). A host read is part of the plan: with
 * one in the step, the data is never taken for dead. */
static void dead_data_not_written_back(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    for (int host_reads = 0; host_reads <= 1; host_reads++) {
        spw_ctx *ctx = plan_ctx();
        spw_buf *b[4]; /* A: overwritten every step, then read; B, C, D read-only */
        assert_ok(spw_buf_create(ctx, SZ, 0, &b[0]));
        for (int i = 1; i < 4; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
        atomic_int bad;
        atomic_init(&bad, 0);
        for (int s = 0; s < 5; s++) {
            assert_ok(spw_step_begin(ctx));
            void *d;
            assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_WRITE, &d));
            test_kfill k = {d, SZ, (uint8_t)(0x10 + s), NULL};
            assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &k));
            assert_ok(spw_release(b[0], NULL));
            for (int i = 1; i < 4; i++) touch(ctx, b[i], SPW_ACCESS_READ);
            assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d)); /* A read after 3 others */
            test_kcheck kc = {d, SZ, (uint8_t)(0x10 + s), NULL, &bad};
            assert_ok(spw_launch_host(ctx, NULL, test_kcheck_cb, &kc));
            assert_ok(spw_release(b[0], NULL));
            for (int i = 1; i < 4; i++) touch(ctx, b[i], SPW_ACCESS_READ);
            if (host_reads) {
                uint8_t probe[16];
                assert_ok(spw_buf_read(b[0], SZ - 16, probe, sizeof probe));
                for (size_t i = 0; i < sizeof probe; i++) assert_int_equal(probe[i], 0x10 + s);
            }
        }
        assert_ok(spw_step_end(ctx));
        assert_int_equal(atomic_load(&bad), 0);
        spw_stats st = test_stats(ctx);
        assert_int_equal(st.plan_divergences.total, 0);
        if (!host_reads) {
            /* A is evicted after its read in every step; from the second step the plan knows
             * its next access overwrites it: dropped, never written back */
            assert_true(st.evictions_dirty.total <= 1);
            assert_true(st.bytes_d2h.total <= (int64_t)SZ);
        } else {
            assert_true(st.bytes_d2h.total >= 4 * (int64_t)SZ); /* read by the host: kept */
        }
        spw_ctx_destroy(ctx);
    }
}

/* A program that leaves the pattern a drop was based on gets an error, never stale data. */
static void read_after_drop_is_an_error(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    /* room for two: each step is A(write) B C A(read) B C; at the second B, A (next access: the
     * overwrite, a step away) is the farthest and free to drop */
    spw_ctx *ctx = test_ctx("budget=5MiB,policy=plan,grow_ahead=0,prefetch=off");
    spw_buf *b[3];
    assert_ok(spw_buf_create(ctx, SZ, 0, &b[0]));
    for (int i = 1; i < 3; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
    void *d;
    for (int s = 0; s < 3; s++) {
        assert_ok(spw_step_begin(ctx));
        touch(ctx, b[0], SPW_ACCESS_WRITE);
        touch(ctx, b[1], SPW_ACCESS_READ);
        touch(ctx, b[2], SPW_ACCESS_READ);
        touch(ctx, b[0], SPW_ACCESS_READ);
        touch(ctx, b[1], SPW_ACCESS_READ);
        touch(ctx, b[2], SPW_ACCESS_READ);
    }
    assert_ok(spw_step_end(ctx));
    assert_false(b[0]->resident);
    assert_true(b[0]->policy_dead);
    assert_int_equal(test_stats(ctx).plan_divergences.total, 0);
    /* this step reads A before writing it: an error naming the cause, never stale contents */
    assert_ok(spw_step_begin(ctx));
    assert_status(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d), SPW_ERR_STATE);
    if (!strstr(spw_last_error(), "dropped by policy=plan")) fail_msg("message: %s", spw_last_error());
    touch(ctx, b[0], SPW_ACCESS_WRITE); /* writing it makes it live again */
    assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[0], NULL));
    assert_ok(spw_step_end(ctx));
    spw_ctx_destroy(ctx);
}

/* Another order: counted as a divergence, no error, LRU for the rest of that step, and the new
 * order is learned for the next step. */
static void divergence_and_relearning(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = plan_ctx();
    spw_buf *b[4];
    for (int i = 0; i < 4; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
    for (int s = 0; s < 2; s++) {
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < 4; i++) touch(ctx, b[i], SPW_ACCESS_READ);
    }
    assert_int_equal(test_stats(ctx).plan_divergences.total, 0);
    int64_t hits0 = test_stats(ctx).plan_hits.total;
    for (int s = 0; s < 3; s++) {
        assert_ok(spw_step_begin(ctx));
        for (int i = 3; i >= 0; i--) touch(ctx, b[i], SPW_ACCESS_READ);
    }
    assert_ok(spw_step_end(ctx));
    spw_stats st = test_stats(ctx);
    assert_int_equal(st.plan_divergences.total, 1); /* the first reversed step only */
    assert_true(st.plan_hits.total - hits0 >= 8);  /* the next two followed the new plan */
    spw_ctx_destroy(ctx);
}

/* A temporary created and destroyed inside every step is identified by its position among the
 * step's creations: the plan keeps following it. */
static void buffers_created_inside_a_step(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = plan_ctx();
    spw_buf *w[2];
    for (int i = 0; i < 2; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &w[i]));
    for (int s = 0; s < 4; s++) {
        assert_ok(spw_step_begin(ctx));
        spw_buf *t;
        assert_ok(spw_buf_create(ctx, SZ, 0, &t));
        touch(ctx, w[0], SPW_ACCESS_READ);
        void *d;
        assert_ok(spw_acquire(t, NULL, SPW_ACCESS_WRITE, &d));
        test_kfill k = {d, SZ, (uint8_t)(0x40 + s), NULL};
        assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &k));
        assert_ok(spw_release(t, NULL));
        touch(ctx, w[1], SPW_ACCESS_READ);
        touch(ctx, t, SPW_ACCESS_READ);
        uint8_t probe[8];
        assert_ok(spw_buf_read(t, 0, probe, sizeof probe));
        assert_int_equal(probe[0], 0x40 + s);
        assert_ok(spw_buf_destroy(t));
    }
    assert_ok(spw_step_end(ctx));
    spw_stats st = test_stats(ctx);
    assert_int_equal(st.plan_divergences.total, 0);
    assert_int_equal(st.plan_hits.total, 3 * 5); /* steps 2-4: four acquisitions, one host read */
    spw_ctx_destroy(ctx);
}

/* Fault sweep under policy=plan: every memcpy, event and wait on the paths fails in turn; the
 * dirty buffers' contents survive (every byte checked), and nothing leaks. */
static void no_data_loss_under_faults(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    const spw_call kinds[] = {SPW_CALL_MEMCPY, SPW_CALL_EVENT_RECORD, SPW_CALL_STREAM_WAIT, SPW_CALL_MAP};
    uint8_t *buf = malloc(SZ);
    int fired = 0;
    for (size_t kk = 0; kk < sizeof kinds / sizeof kinds[0]; kk++) {
        for (unsigned long n = 1; n <= 40; n += 3) {
            spw_ctx *ctx = plan_ctx();
            spw_buf *b[4];
            uint8_t want[4];
            for (int i = 0; i < 4; i++) {
                assert_ok(spw_buf_create(ctx, SZ, 0, &b[i]));
                want[i] = (uint8_t)(i + 1);
                memset(buf, want[i], SZ);
                assert_ok(spw_buf_write(b[i], 0, buf, SZ));
            }
            spw__emu_inject(ctx->backend, kinds[kk], n, 0);
            for (int s = 0; s < 4; s++) {
                assert_ok(spw_step_begin(ctx));
                for (int i = 0; i < 4; i++) {
                    void *d;
                    spw_status st = spw_acquire(b[i], NULL, SPW_ACCESS_READ_WRITE, &d);
                    if (st) {
                        fired++;
                        assert_true(strlen(spw_last_error()) > 0);
                        continue;
                    }
                    test_kfill k = {d, SZ, (uint8_t)(want[i] + 16), NULL};
                    st = spw_launch_host(ctx, NULL, test_kfill_cb, &k);
                    if (!st) want[i] = (uint8_t)(want[i] + 16);
                    else fired++;
                    for (int tries = 0; spw_release(b[i], NULL) != SPW_OK; tries++) {
                        assert_true(tries < 3); /* a failed release changes nothing: retry */
                        fired++;
                    }
                    assert_ok(spw_stream_synchronize(ctx, NULL));
                }
            }
            spw__emu_clear_faults(ctx->backend);
            assert_ok(spw_step_end(ctx));
            for (int i = 0; i < 4; i++) {
                assert_ok(spw_buf_read(b[i], 0, buf, SZ));
                for (size_t j = 0; j < SZ; j += 4093)
                    if (buf[j] != want[i]) fail_msg("%s fault #%lu: buffer %d byte %zu is %u, want %u",
                                                    spw__call_name(kinds[kk]), n, i, j, buf[j], want[i]);
            }
            for (int i = 0; i < 4; i++) assert_ok(spw_buf_destroy(b[i]));
            assert_ok(spw_empty_cache(ctx));
            assert_int_equal(spw__emu_used(ctx->backend), 0);
            spw_ctx_destroy(ctx);
        }
    }
    assert_true(fired > 0);
    free(buf);
}

/* ---- prefetch (prefetch=on, as on a GPU; emu's default is off) ---- */

/* Cyclic A B C D, room for three, prefetch on without early slots. The hand-checked schedule of
 * the first planned step, from the start state A B D (see exact_victims): at step_begin nothing
 * more (C would displace D, but A and B, used before C, will be the later-needed victims once
 * released: the floor rule); after A nothing (the same); after B, C comes in for A (released,
 * needed next step); after C nothing (B would go, but D, released next, is the better victim);
 * after D, A comes in for C (the wrap into the next step). */
static void prefetch_schedule(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = test_ctx("budget=7MiB,policy=plan,grow_ahead=0,prefetch=on,prefetch_early=0");
    spw_buf *b[4];
    for (int i = 0; i < 4; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
    assert_ok(spw_step_begin(ctx));
    for (int i = 0; i < 4; i++) touch(ctx, b[i], SPW_ACCESS_READ);
    resident_is(b, "0111");
    assert_int_equal(test_stats(ctx).plan_prefetch_bytes.total, 0); /* no plan yet: LRU, no prefetch */
    int64_t h0 = test_stats(ctx).bytes_h2d.total;
    assert_ok(spw_step_begin(ctx));
    resident_is(b, "1101");
    touch(ctx, b[0], SPW_ACCESS_READ);
    resident_is(b, "1101");
    touch(ctx, b[1], SPW_ACCESS_READ);
    resident_is(b, "0111");
    touch(ctx, b[2], SPW_ACCESS_READ);
    resident_is(b, "0111");
    touch(ctx, b[3], SPW_ACCESS_READ);
    resident_is(b, "1101");
    spw_stats st = test_stats(ctx);
    assert_int_equal(st.bytes_h2d.total - h0, 3 * (int64_t)SZ); /* A (start state), C, A */
    assert_int_equal(st.plan_prefetch_bytes.total, 3 * (int64_t)SZ);
    assert_int_equal(st.plan_prefetch_used.total, 2 * (int64_t)SZ); /* the last A waits */
    assert_int_equal(st.plan_prefetch_wasted.total, 0);
    /* a user hint the plan would pay for is declined: C is needed after B, and bringing it now
     * could only displace A, which B (released after its use) outlasts; nothing moves and the
     * hint succeeds */
    assert_ok(spw_step_begin(ctx));
    touch(ctx, b[0], SPW_ACCESS_READ);
    resident_is(b, "1101");
    h0 = test_stats(ctx).bytes_h2d.total;
    assert_ok(spw_prefetch(b[2], NULL));
    resident_is(b, "1101");
    assert_int_equal(test_stats(ctx).bytes_h2d.total, h0);
    assert_int_equal(test_stats(ctx).plan_divergences.total, 0);
    assert_ok(spw_step_end(ctx));
    spw_ctx_destroy(ctx);
}

/* Between steps the static split keeps its copies in flight, as a hand-written loop does: after
 * the step_end of a confirmed step the first streamed buffer of the next step is already on its
 * way. Cyclic A B C D, room for three: STATIC fixes one and streams the others through two
 * buffers of room; at step_end B comes in for D, which is needed last. When D is written by
 * every step it is dirty at step_end: it is not a victim then (the caller may read what the
 * step wrote, and a write-back would cost a transfer), and nothing else may go (A is needed
 * before B), so nothing moves until the next step begins. */
static void prefetch_across_steps(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    uint8_t *host = malloc(SZ);
    for (int written = 0; written < 2; written++) {
        /* the pipeline the timing picks on a link */
        spw_ctx *ctx = test_ctx("budget=7MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=split");
        spw_buf *b[4];
        for (int i = 0; i < 4; i++)
            assert_ok(spw_buf_create(ctx, SZ, i == 3 && written ? 0 : SPW_BUF_READ_ONLY, &b[i]));
        for (uint8_t s = 1; s <= 4; s++) {
            assert_ok(spw_step_begin(ctx));
            for (int i = 0; i < 3; i++) touch(ctx, b[i], SPW_ACCESS_READ);
            void *d;
            assert_ok(spw_acquire(b[3], NULL, written ? SPW_ACCESS_WRITE : SPW_ACCESS_READ, &d));
            test_kfill k = {d, SZ, s, NULL};
            if (written) assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &k));
            assert_ok(spw_release(b[3], NULL));
            assert_ok(spw_stream_synchronize(ctx, NULL));
            spw_stats before = test_stats(ctx);
            assert_ok(spw_step_end(ctx));
            assert_ok(spw_stream_synchronize(ctx, NULL));
            spw_stats after = test_stats(ctx);
            if (s >= 2) { /* step 1 records; step 2 follows the plan and confirms it */
                resident_is(b, written ? "1011" : "1110");
                assert_int_equal(after.bytes_h2d.total - before.bytes_h2d.total, written ? 0 : (int64_t)SZ);
            }
            assert_int_equal(after.evictions_dirty.total, before.evictions_dirty.total);
            if (written) {
                assert_ok(spw_buf_read(b[3], 0, host, SZ));
                assert_int_equal(host[0], s);
                assert_int_equal(host[SZ - 1], s);
            }
        }
        assert_int_equal(test_stats(ctx).plan_divergences.total, 0);
        spw_ctx_destroy(ctx);
    }
    free(host);
}

/* Prefetch on against off over the same read-modify-write steps: every prefetched byte is used,
 * the double buffer costs at most one buffer a step on average, and every byte is right at the end. With
 * early slots (prefetch_early=2) the same holds except that an early prefetch may be wasted. */
static void prefetch_costs_at_most_one_buffer(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 6, STEPS = 8 };
    const char *confs[] = {"budget=9MiB,policy=plan,grow_ahead=0,prefetch=off",
                           "budget=9MiB,policy=plan,grow_ahead=0,prefetch=on,prefetch_early=0",
                           "budget=9MiB,policy=plan,grow_ahead=0,prefetch=on,prefetch_early=2"};
    int64_t per_step[3][STEPS];
    uint8_t *tmp = malloc(SZ);
    for (int c = 0; c < 3; c++) {
        spw_ctx *ctx = test_ctx(confs[c]);
        spw_buf *b[NB];
        for (int i = 0; i < NB; i++) {
            assert_ok(spw_buf_create(ctx, SZ, 0, &b[i]));
            memset(tmp, i, SZ);
            assert_ok(spw_buf_write(b[i], 0, tmp, SZ));
        }
        for (int s = 0; s < STEPS; s++) {
            int64_t h0 = test_stats(ctx).bytes_h2d.total;
            assert_ok(spw_step_begin(ctx));
            for (int i = 0; i < NB; i++) {
                void *d;
                assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ_WRITE, &d));
                test_kfill k = {d, SZ, (uint8_t)(i + 16 * (s + 1)), NULL};
                assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &k));
                assert_ok(spw_release(b[i], NULL));
                assert_ok(spw_stream_synchronize(ctx, NULL));
            }
            per_step[c][s] = test_stats(ctx).bytes_h2d.total - h0;
        }
        assert_ok(spw_step_end(ctx));
        spw_stats st = test_stats(ctx);
        assert_int_equal(st.plan_divergences.total, 0);
        if (c == 0) { /* only the move to the start state, once, every byte of it used */
            assert_true(st.plan_prefetch_bytes.total <= (int64_t)(9 * MiB));
            assert_int_equal(st.plan_prefetch_wasted.total, 0);
        } else {
            assert_true(st.plan_prefetch_bytes.total > 0);
            if (c == 1) assert_int_equal(st.plan_prefetch_wasted.total, 0);
            /* every prefetched byte is used, wasted, or still waiting for the next step */
            int64_t waiting = 0;
            for (int i = 0; i < NB; i++) waiting += b[i]->resident && b[i]->prefetched ? (int64_t)SZ : 0;
            assert_int_equal(st.plan_prefetch_used.total + st.plan_prefetch_wasted.total + waiting,
                             st.plan_prefetch_bytes.total);
        }
        for (int i = 0; i < NB; i++) {
            assert_ok(spw_buf_read(b[i], 0, tmp, SZ));
            for (size_t j = 0; j < SZ; j += 4093)
                if (tmp[j] != (uint8_t)(i + 16 * STEPS)) fail_msg("%s: buffer %d byte %zu is %u", confs[c], i, j, tmp[j]);
        }
        spw_ctx_destroy(ctx);
    }
    free(tmp);
    /* over the planned steps after the first: the double buffer costs at most one buffer a step
     * on average (per step the phase of the cycle moves it between steps) */
    int64_t sum_on = 0, sum_off = 0;
    for (int s = 2; s < STEPS; s++) {
        sum_on += per_step[1][s];
        sum_off += per_step[0][s];
        assert_true(per_step[0][s] < (int64_t)(NB * SZ)); /* the plan beats LRU's every-buffer */
    }
    if (sum_on > sum_off + (STEPS - 2) * (int64_t)SZ)
        fail_msg("steps 2..%d: %lld B with prefetch, %lld B without", STEPS - 1, (long long)sum_on,
                 (long long)sum_off);
}



enum { SLOT_NB = 8 };
#define SLOT_L (4 * MiB)

/* Eight read-only 4 MiB buffers filled with 0x30 + i under 18 MiB, pipeline SLOT in force (as the
 * timing may pick it on a link). */
static spw_ctx *slot_ctx(spw_buf *b[SLOT_NB]) {
    spw_ctx *ctx = test_ctx("budget=18MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=slot,vmm=on,"
                            "vmm_large_page=2MiB");
    for (int i = 0; i < SLOT_NB; i++) {
        assert_ok(spw_buf_create(ctx, SLOT_L, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(0x30 + i));
    }
    return ctx;
}

/* SLOT keeps one buffer of room and a quarter for the streamed buffers instead of two, so one
 * more is fixed. Eight 4 MiB buffers read in order under 18 MiB: STATIC fixes 2 and streams 6
 * a step; SLOT fixes 3 (spread: C F H), takes up the 6 MiB left as one piece, and streams 5 a
 * step, each upload evicting the buffer streamed before it. Prefetch hints are declined (one
 * for the buffer after next would displace the next: A B and D E are streamed back to back).
 * Every read sees its buffer's bytes. */
static void split_with_one_slot(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = SLOT_NB, STEPS = 8 };
    const size_t L = SLOT_L;
    spw_buf *b[NB];
    spw_ctx *ctx = slot_ctx(b);
    atomic_int bad;
    atomic_init(&bad, 0);
    test_kcheck k[NB];
    int64_t h0 = 0;
    unsigned long c0 = 0;
    for (int s = 0; s < STEPS; s++) {
        if (s == STEPS - 3) {
            h0 = test_stats(ctx).bytes_h2d.total;
            c0 = spw__emu_calls(ctx->backend, SPW_CALL_MEMCPY);
        }
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            /* a hint for the buffer after next, as bench stream gives */
            assert_ok(spw_prefetch(b[(i + 2) % NB], NULL));
            test_checked_read(ctx, b[i], (uint8_t)(0x30 + i), &k[i], &bad);
        }
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_stream_synchronize(ctx, NULL));
    }
    int fixed = 0;
    for (int i = 0; i < NB; i++) fixed += kb_of(b[i])->fixed && b[i]->resident;
    assert_int_equal(fixed, 3);
    assert_int_equal(test_stats(ctx).bytes_h2d.total - h0, 3 * 5 * (int64_t)L);
    /* each upload in two pieces: the half beside the buffer it replaces, then the rest */
    assert_int_equal(spw__emu_calls(ctx->backend, SPW_CALL_MEMCPY) - c0, 2 * 3 * 5);
    assert_int_equal(atomic_load(&bad), 0);
    assert_true(test_stats(ctx).held.peak <= 18 * (int64_t)MiB);
    assert_ok(spw__arena_check(ctx->large));
    assert_int_equal(test_stats(ctx).plan_divergences.total, 0);
    spw_ctx_destroy(ctx);
}

/* SLOT's fixed set and its room must hold for the pipeline to pay. Something displaces the fixed
 * set every step (the user evicts the fixed C after each use: each step boundary takes it up
 * again, synchronizing the streams), or the device memory is trimmed during every step (counted
 * as the arena counts its trims): when SLOT_BROKEN_OF_8 of the last eight steps were broken the
 * policy leaves SLOT for the best other pipeline; one trim in eight steps does not make it leave.
 * The data stays right throughout. */
static void slot_run(int how) {
    TEST_REQUIRE_EMU();
    enum { NB = SLOT_NB, STEPS = 10 };
    spw_buf *b[NB];
    spw_ctx *ctx = slot_ctx(b);
    spw_policy *pol = ctx->engine->pol;
    atomic_int bad;
    atomic_init(&bad, 0);
    test_kcheck k[NB];
    int slot_steps = 0;
    for (int s = 0; s < STEPS; s++) {
        assert_ok(spw_step_begin(ctx));
        slot_steps += pol->early_max == PF_SLOT;
        for (int i = 0; i < NB; i++) {
            test_checked_read(ctx, b[i], (uint8_t)(0x30 + i), &k[i], &bad);
            if (how == 0 && i == 2 && s >= 1) assert_ok(spw_evict(b[2]));
            if (i == 2 && (how == 1 || (how == 2 && s == 4))) ctx->stats.trim_syncs.total++;
        }
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_stream_synchronize(ctx, NULL));
    }
    if (how == 2) {
        assert_int_equal(pol->early_max, PF_SLOT);
        assert_false(pol->slot_left);
    } else {
        assert_int_not_equal(pol->early_max, PF_SLOT);
        assert_true(pol->slot_left);
        assert_true(slot_steps >= SLOT_BROKEN_OF_8 && slot_steps < STEPS);
    }
    assert_int_equal(atomic_load(&bad), 0);
    spw_ctx_destroy(ctx);
}

static void split_with_one_slot_left_when_displaced(void **state) {
    (void)state;
    slot_run(0);
}

static void split_with_one_slot_left_when_trimming(void **state) {
    (void)state;
    slot_run(1);
    slot_run(2);
}

/* The summary says what the policy learned and does: nothing before the first step, then the
 * plan's length and the pipeline (here none: prefetch=off). */
static void summary_line(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = plan_ctx();
    spw_buf *b[4];
    for (int i = 0; i < 4; i++) assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
    char *text = test_summary(ctx, 0);
    assert_non_null(strstr(text, "policy plan: no plan yet"));
    free(text);
    for (int s = 0; s < 2; s++) {
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < 4; i++) touch(ctx, b[i], SPW_ACCESS_READ);
    }
    text = test_summary(ctx, 0);
    assert_non_null(strstr(text, "policy plan: 4 acquisitions a step; no prefetch (prefetch=off)"));
    free(text);
    spw_ctx_destroy(ctx);
    /* one acquisition a step: singular */
    ctx = plan_ctx();
    assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[0]));
    for (int s = 0; s < 2; s++) {
        assert_ok(spw_step_begin(ctx));
        touch(ctx, b[0], SPW_ACCESS_READ);
    }
    text = test_summary(ctx, 0);
    assert_non_null(strstr(text, "policy plan: 1 acquisition a step; "));
    free(text);
    spw_ctx_destroy(ctx);
}

/* pipeline=NAME runs that pipeline from the first step that follows the plan, untimed: no trial
 * opens, the summary names it, a split marks its fixed set, and every byte read is right. With
 * prefetch off the name changes nothing. */
static void a_named_pipeline_runs_untimed(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    static const struct {
        const char *conf, *summary;
        int mode;
    } cases[] = {
        {"budget=7MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=none", "pipeline no prefetch, as named", PF_OFF},
        {"budget=7MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=double", "pipeline double buffer, as named", 0},
        {"budget=7MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=split", "pipeline static split, as named", PF_STATIC},
        {"budget=7MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=slot", "pipeline split with one slot, as named", PF_SLOT},
        {"budget=7MiB,policy=plan,grow_ahead=0,prefetch=off,pipeline=split", "no prefetch (prefetch=off)", 0},
    };
    enum { NB = 6, STEPS = 6 };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        spw_ctx *ctx = test_ctx(cases[c].conf);
        spw_policy *pol = ctx->engine->pol;
        spw_buf *b[NB];
        for (int i = 0; i < NB; i++) {
            assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
            test_fill_buf(b[i], (uint8_t)(0x30 + i));
        }
        atomic_int bad;
        atomic_init(&bad, 0);
        test_kcheck kc[NB];
        for (int s = 0; s < STEPS; s++) {
            assert_ok(spw_step_begin(ctx));
            for (int i = 0; i < NB; i++) test_checked_read(ctx, b[i], (uint8_t)(0x30 + i), &kc[i], &bad);
            assert_ok(spw_step_end(ctx));
            assert_ok(spw_stream_synchronize(ctx, NULL));
            assert_int_equal(pol->trial, -1);
        }
        assert_int_equal(atomic_load(&bad), 0);
        assert_int_equal(pol->early_max, cases[c].mode);
        int fixed = 0;
        for (int i = 0; i < NB; i++) fixed += kb_of(b[i])->fixed;
        assert_true(spw__plan_fixed_pipeline(cases[c].mode) ? fixed > 0 && fixed < NB : fixed == 0);
        char *text = test_summary(ctx, 0);
        assert_non_null(strstr(text, cases[c].summary));
        free(text);
        spw_ctx_destroy(ctx);
    }
    spw_config *cfg = NULL;
    assert_ok(spw_config_create(&cfg));
    assert_status(spw_config_set(cfg, "pipeline", "fastest"), SPW_ERR_CONFIG);
    assert_non_null(strstr(spw_last_error(), "auto|none|double|split|slot"));
    char v[16];
    assert_ok(spw_config_get(cfg, "pipeline", v, sizeof v));
    assert_string_equal(v, "auto");
    spw_config_destroy(cfg);
}

/* Buffers of mixed sizes cycled at a budget that holds about half of them: once the plan is
 * learned no upload waits on the host for a trim; its room is one run of adjacent blocks given
 * up (window_evictions), and every byte read is right. */
static void mixed_sizes_need_no_trim(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 7, STEPS = 10 };
    const size_t mib[NB] = {3, 5, 2, 7, 4, 6, 1};
    spw_ctx *ctx = test_ctx("budget=16MiB,policy=plan,grow_ahead=0,prefetch=off,vmm=on");
    spw_buf *b[NB];
    for (int i = 0; i < NB; i++) {
        assert_ok(spw_buf_create(ctx, mib[i] * MiB + 4096 * (size_t)i, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(0x30 + i));
    }
    atomic_int bad;
    atomic_init(&bad, 0);
    int64_t trims_before = 0;
    for (int s = 0; s < STEPS; s++) {
        if (s == 3) trims_before = test_stats(ctx).trim_syncs.total;
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            test_kcheck kc;
            test_checked_read(ctx, b[i], (uint8_t)(0x30 + i), &kc, &bad);
            assert_ok(spw_stream_synchronize(ctx, NULL));
        }
    }
    assert_ok(spw_step_end(ctx));
    spw_stats st = test_stats(ctx);
    assert_int_equal(atomic_load(&bad), 0);
    assert_int_equal(st.plan_divergences.total, 0);
    assert_int_equal(st.trim_syncs.total - trims_before, 0);
    assert_true(st.window_evictions.total > 0);
    assert_true(st.held.peak <= 16 * (int64_t)MiB);
    spw_ctx_destroy(ctx);
}

/* The static split in whole segments (vmm off): each streamed buffer, whatever its size, takes a
 * block of the largest one's, so every upload reuses the block the buffer it replaces left. Once
 * the split is in force no upload trims (which would return every cached segment and drain the
 * device); fixed buffers keep blocks of their own sizes, the weights still move every step, and
 * every byte read is right. */
static void static_split_in_segments_needs_no_trim(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 12, STEPS = 12, FROM = 4 };
    const size_t mib[NB] = {6, 4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5};
    spw_ctx *ctx = test_ctx("budget=30MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=split,vmm=off");
    spw_policy *pol = ctx->engine->pol;
    spw_buf *b[NB];
    for (int i = 0; i < NB; i++) {
        assert_ok(spw_buf_create(ctx, mib[i] * MiB, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(0x40 + i));
    }
    atomic_int bad;
    atomic_init(&bad, 0);
    int64_t trims0 = 0, h2d0 = 0;
    for (int s = 0; s < STEPS; s++) {
        if (s == FROM) {
            spw_stats st = test_stats(ctx);
            trims0 = st.trim_syncs.total;
            h2d0 = st.bytes_h2d.total;
        }
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            test_kcheck kc;
            test_checked_read(ctx, b[i], (uint8_t)(0x40 + i), &kc, &bad);
            assert_ok(spw_stream_synchronize(ctx, NULL));
        }
        assert_ok(spw_step_end(ctx));
        if (s < FROM) continue;
        int streamed = 0;
        for (int i = 0; i < NB; i++) {
            kbuf *k = kb_of(b[i]);
            if (!b[i]->resident) continue;
            size_t want = k->fixed ? mib[i] * MiB : 6 * MiB;
            if (spw__pol_device_bytes(b[i]) != want)
                fail_msg("step %d: buffer %d (%zu MiB, %s) holds a block of %zu B, want %zu", s, i, mib[i],
                         k->fixed ? "fixed" : "streamed", spw__pol_device_bytes(b[i]), want);
            streamed += !k->fixed;
        }
        assert_true(streamed <= 2);
    }
    spw_stats st = test_stats(ctx);
    assert_int_equal(atomic_load(&bad), 0);
    assert_int_equal(pol->early_max, PF_STATIC);
    assert_int_equal(st.plan_divergences.total, 0);
    assert_int_equal(st.trim_syncs.total - trims0, 0);
    assert_true(st.bytes_h2d.total - h2d0 >= (int64_t)((STEPS - FROM) * 20 * MiB)); /* 60 MiB through 30 */
    assert_true(st.held.peak <= 30 * (int64_t)MiB);
    spw_ctx_destroy(ctx);
}

/* The static split in pages: its streamed buffers, of several sizes, take the room in turn, each
 * upload placed after the one before it (a ring) and evicting the oldest. Once the split is in
 * force every streamed upload is placed so and none trims; the fixed set stays, the weights move
 * every step, and every byte read is right. Off (ring=off), the same cycle places none so. */
static void static_split_in_pages_streams_through_a_ring(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 12, STEPS = 12, FROM = 4 };
    const size_t kib[NB] = {6144, 3072, 5120, 2048, 4096, 6144, 1024, 5120, 3072, 6144, 2048, 4096};
    for (int ring = 1; ring >= 0; ring--) {
        spw_ctx *ctx = test_ctx(ring ? "budget=32MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=split,vmm=on,ring=on"
                                     : "budget=32MiB,policy=plan,grow_ahead=0,prefetch=on,pipeline=split,vmm=on,ring=off");
        spw_policy *pol = ctx->engine->pol;
        spw_buf *b[NB];
        size_t total = 0;
        for (int i = 0; i < NB; i++) {
            assert_ok(spw_buf_create(ctx, kib[i] * 1024, SPW_BUF_READ_ONLY, &b[i]));
            test_fill_buf(b[i], (uint8_t)(0x50 + i));
            total += kib[i] * 1024;
        }
        atomic_int bad;
        atomic_init(&bad, 0);
        spw_stats st0 = {0};
        size_t streamed = 0;
        test_kcheck kc[NB]; /* read by the device after the loop moves on: one each */
        for (int s = 0; s < STEPS; s++) {
            if (s == FROM) {
                st0 = test_stats(ctx);
                for (int i = 0; i < NB; i++) streamed += kb_of(b[i])->fixed ? 0 : kib[i] * 1024;
            }
            assert_ok(spw_step_begin(ctx));
            for (int i = 0; i < NB; i++) test_checked_read(ctx, b[i], (uint8_t)(0x50 + i), &kc[i], &bad);
            assert_ok(spw_step_end(ctx));
            assert_ok(spw_stream_synchronize(ctx, NULL));
        }
        spw_stats st = test_stats(ctx);
        int nstreamed = 0;
        for (int i = 0; i < NB; i++) nstreamed += !kb_of(b[i])->fixed;
        assert_int_equal(atomic_load(&bad), 0);
        assert_int_equal(pol->early_max, PF_STATIC);
        assert_int_equal(st.plan_divergences.total, 0);
        assert_true(nstreamed > 2 && streamed > 0 && streamed + 32 * MiB > total);
        if (ring) {
            assert_int_equal(st.trim_syncs.total - st0.trim_syncs.total, 0);
            assert_int_equal(st.ring_uploads.total - st0.ring_uploads.total, (STEPS - FROM) * nstreamed);
            assert_true(st.bytes_h2d.total - st0.bytes_h2d.total >= (int64_t)((STEPS - FROM) * streamed));
        } else {
            assert_int_equal(st.ring_uploads.total, 0);
        }
        assert_true(st.held.peak <= 32 * (int64_t)MiB);
        spw_ctx_destroy(ctx);
    }
}

/* A buffer written on the caller's stream (no upload) at the budget, where no cached block
 * holds it: its room is a run of the H2D stream's blocks (a window), taken without a trim;
 * the victims' contents and its own stay intact. */
static void write_on_the_callers_stream_needs_no_trim(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 4 };
    const size_t mib[NB] = {3, 5, 2, 6};
    spw_ctx *ctx = test_ctx("budget=16MiB,policy=lru,grow_ahead=0,prefetch=off,vmm=on");
    spw_buf *b[NB], *w;
    uint8_t *tmp = malloc(8 * MiB);
    for (int i = 0; i < NB; i++) { /* uploaded: their blocks are the H2D stream's */
        assert_ok(spw_buf_create(ctx, mib[i] * MiB, SPW_BUF_READ_ONLY, &b[i]));
        memset(tmp, 0x40 + i, mib[i] * MiB);
        assert_ok(spw_buf_write(b[i], 0, tmp, mib[i] * MiB));
        void *d;
        assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ, &d));
        assert_ok(spw_release(b[i], NULL));
    }
    assert_ok(spw_stream_synchronize(ctx, NULL));
    int64_t trims = test_stats(ctx).trim_syncs.total;
    assert_ok(spw_buf_create(ctx, 7 * MiB, 0, &w));
    void *d;
    assert_ok(spw_acquire(w, NULL, SPW_ACCESS_WRITE, &d));
    test_kfill k = {d, 7 * MiB, 0x7a, NULL};
    assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &k));
    assert_ok(spw_release(w, NULL));
    assert_ok(spw_stream_synchronize(ctx, NULL));
    spw_stats st = test_stats(ctx);
    assert_int_equal(st.trim_syncs.total - trims, 0);
    assert_true(st.window_evictions.total > 0);
    assert_true(st.held.peak <= 16 * (int64_t)MiB);
    memset(tmp, 0, 7 * MiB);
    assert_ok(spw_buf_read(w, 0, tmp, 7 * MiB));
    for (size_t i = 0; i < 7 * MiB; i += 4099) assert_int_equal(tmp[i], 0x7a);
    for (int i = 0; i < NB; i++) { /* the victims' contents survive */
        assert_ok(spw_buf_read(b[i], 0, tmp, mib[i] * MiB));
        assert_int_equal(tmp[0], 0x40 + i);
        assert_int_equal(tmp[mib[i] * MiB - 1], 0x40 + i);
    }
    free(tmp);
    spw_ctx_destroy(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(exact_victims),
        cmocka_unit_test(mixed_sizes_need_no_trim),
        cmocka_unit_test(static_split_in_segments_needs_no_trim),
        cmocka_unit_test(static_split_in_pages_streams_through_a_ring),
        cmocka_unit_test(write_on_the_callers_stream_needs_no_trim),
        cmocka_unit_test(dead_data_not_written_back),
        cmocka_unit_test(read_after_drop_is_an_error),
        cmocka_unit_test(divergence_and_relearning),
        cmocka_unit_test(buffers_created_inside_a_step),
        cmocka_unit_test(no_data_loss_under_faults),
        cmocka_unit_test(prefetch_schedule),
        cmocka_unit_test(prefetch_across_steps),
        cmocka_unit_test(prefetch_costs_at_most_one_buffer),
        cmocka_unit_test(split_with_one_slot),
        cmocka_unit_test(split_with_one_slot_left_when_displaced),
        cmocka_unit_test(split_with_one_slot_left_when_trimming),
        cmocka_unit_test(summary_line),
        cmocka_unit_test(a_named_pipeline_runs_untimed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
