/* policy=plan chooses its pipeline by timing steps (prefetch_early=auto), here on the emulated
 * device with a simulated link. A timing test: it runs alone (RUN_SERIAL) and not under the
 * sanitizers, whose overhead is not the workload's. emu only. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "test_util.h"

#define MiB ((size_t)1 << 20)


/* The pipeline is chosen by timing (prefetch_early=auto), on an emulated link of 1 GB/s: with
 * no work to hide transfers behind, no prefetch at all wins (Belady's fewest bytes); with work
 * longer than a transfer, a pipeline that moves one buffer more per step but overlaps it does.
 * Cyclic 8 buffers of 8 MiB (8.4 ms on the link), room for 5; the steady bytes per step tell
 * which was kept. */
static void sleep_cb(void *a) {
    long us = *(const long *)a;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* `wait`: the caller waits for each step's work (as a training loop reading its loss does), or
 * never does (inference enqueued back to back, run ahead of the device). */
static int64_t phases_bytes(long work0_us, int steps0, long work_us, int steps, bool wait, char **summary) {
    enum { NB = 8 };
    const int STEPS = steps0 + steps;
    const size_t sz = 8 * MiB;
    spw_ctx *ctx = test_ctx("budget=41MiB,policy=plan,grow_ahead=0,prefetch=on,emu_link_gbps=1");
    spw_buf *b[NB];
    for (int i = 0; i < NB; i++) assert_ok(spw_buf_create(ctx, sz, SPW_BUF_READ_ONLY, &b[i]));
    int64_t h0 = 0;
    for (int s = 0; s < STEPS; s++) {
        long *work = s < steps0 ? &work0_us : &work_us;
        if (s == STEPS - 3) h0 = test_stats(ctx).bytes_h2d.total;
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            void *d;
            assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ, &d));
            assert_ok(spw_launch_host(ctx, NULL, sleep_cb, work));
            assert_ok(spw_release(b[i], NULL));
        }
        assert_ok(spw_step_end(ctx));
        if (wait) assert_ok(spw_stream_synchronize(ctx, NULL));
    }
    assert_ok(spw_stream_synchronize(ctx, NULL));
    int64_t moved = test_stats(ctx).bytes_h2d.total - h0;
    char *text = test_summary(ctx, 0);
    assert_non_null(strstr(text, "chosen by timing")); /* the summary names the pipeline kept */
    if (summary) *summary = text;
    else free(text);
    assert_int_equal(test_stats(ctx).plan_divergences.total, 0);
    spw_ctx_destroy(ctx);
    return moved / (int64_t)sz; /* buffers moved in the last three steps */
}

static int64_t steady_bytes(long work_us, bool wait) { return phases_bytes(work_us, 0, work_us, 15, wait, NULL); }

/* No work: no prefetch at all (Belady's fewest bytes); 12 ms of work a buffer: an overlapping
 * pipeline. In three steps, Belady with room for 5 of 8 moves 10-11 (24/7 a step); an
 * overlapping pipeline keeps room for the transfer in flight: 12 (double buffer) to 15 (split). */
static void check_choices(bool wait) {
    int64_t idle = steady_bytes(0, wait), busy = steady_bytes(12000, wait);
    if (!(idle <= 11)) fail_msg("no work: %lld buffers in 3 steps, want Belady's 10-11 (no prefetch)", (long long)idle);
    if (!(busy >= 12)) fail_msg("12 ms of work a buffer: %lld buffers in 3 steps, want an overlapping pipeline's 12-15",
                                (long long)busy);
}

static void pipeline_chosen_by_timing(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    check_choices(true);
}

/* The same choices when the caller never waits: the trial steps are timed to the end of their
 * work on the device, not to the end of their enqueueing (which is all about the same). */
static void pipeline_chosen_by_device_time(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    check_choices(false);
}

/* The work of a step changes after the choice (no work, then 12 ms a buffer, as a batch size
 * raised): a recheck sees the step time move and times the pipelines again; the caller never
 * waits. */
static void pipeline_timed_again_when_the_work_changes(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    char *text = NULL;
    int64_t busy = phases_bytes(0, 16, 12000, 56, false, &text);
    if (!(busy >= 12)) fail_msg("12 ms of work a buffer after 16 idle steps: %lld buffers in 3 steps, want 12-15\n%s",
                                (long long)busy, text);
    assert_non_null(strstr(text, "timed again after the step time moved (1 so far)"));
    free(text);
}

/* Eight buffers of 8 MiB read in turn under 41 MiB on a 1 GB/s link, no work, for `steps` steps,
 * with a host hiccup of `us` in the `nth` step that runs while the summary says "timing
 * pipelines: <pipeline> now" (mid-step). *ran: the steps run under that line; *moved: buffers
 * uploaded over the last three steps. Returns the context, for its summary. */
static spw_ctx *hiccup_run(const char *pipeline, int nth, long us, int steps, int *ran, int64_t *moved) {
    enum { NB = 8 };
    const size_t sz = 8 * MiB;
    spw_ctx *ctx = test_ctx("budget=41MiB,policy=plan,grow_ahead=0,prefetch=on,emu_link_gbps=1");
    spw_buf *b[NB];
    for (int i = 0; i < NB; i++) assert_ok(spw_buf_create(ctx, sz, SPW_BUF_READ_ONLY, &b[i]));
    char now[96];
    snprintf(now, sizeof now, "timing pipelines: %s now", pipeline);
    long none = 0;
    int hiccups = 0;
    int64_t h0 = 0;
    *ran = 0;
    for (int s = 0; s < steps; s++) {
        if (s == steps - 3) h0 = test_stats(ctx).bytes_h2d.total;
        assert_ok(spw_step_begin(ctx)); /* times the step before: the summary says what this one runs */
        char *text = test_summary(ctx, 0);
        bool in = strstr(text, now) != NULL;
        free(text);
        *ran += in;
        for (int i = 0; i < NB; i++) {
            void *d;
            assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ, &d));
            bool hit = in && *ran == nth && i == NB / 2;
            hiccups += hit;
            assert_ok(spw_launch_host(ctx, NULL, sleep_cb, hit ? &us : &none));
            assert_ok(spw_release(b[i], NULL));
        }
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_stream_synchronize(ctx, NULL));
    }
    assert_int_equal(hiccups, 1);
    *moved = (test_stats(ctx).bytes_h2d.total - h0) / (int64_t)sz;
    return ctx;
}

/* A hiccup of the host in the timed step of the pipeline that wins (no prefetch, with no work to
 * hide transfers behind): slower than its settle step, that step is timed once more, and the
 * choice stands. The steps of that trial are found by the summary ("no prefetch now"). */
static void a_hiccup_in_a_trial_does_not_decide(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    int off_steps;
    int64_t moved;
    spw_ctx *ctx = hiccup_run("no prefetch", 2, 200000, 18, &off_steps, &moved);
    char *text = test_summary(ctx, 0);
    const char *line = strstr(text, "policy plan");
    if (off_steps != 3)
        fail_msg("no prefetch timed in %d steps, want 3 (settle, the hiccup, once more): %.300s", off_steps, line);
    if (!strstr(text, "pipeline no prefetch, chosen by timing") || !(moved <= 11))
        fail_msg("want no prefetch kept (Belady's 10-11 buffers in 3 steps), moved %lld: %.300s", (long long)moved,
                 line);
    free(text);
    spw_ctx_destroy(ctx);
}

/* A settle step far slower than the fastest pipeline timed so far (a 300 ms hiccup in the double
 * buffer's, the last trial) ends that trial untimed: its pipeline runs one step, not two, is not
 * chosen, and the summary says it was timed by its settle step alone. */
static void a_slow_settle_step_ends_its_trial(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    int db_steps;
    int64_t moved;
    spw_ctx *ctx = hiccup_run("double buffer", 1, 300000, 16, &db_steps, &moved);
    char *text = test_summary(ctx, 0);
    const char *line = strstr(text, "policy plan");
    if (db_steps != 1)
        fail_msg("the double buffer ran %d trial steps, want 1 (its settle step): %.400s", db_steps, line);
    const char *cut = strstr(text, "timed by its settle step alone: ");
    if (!strstr(text, "chosen by timing") || strstr(text, "pipeline double buffer, chosen") || !cut ||
        !strstr(cut, "double buffer"))
        fail_msg("want a choice other than the double buffer, which was cut: %.400s", line);
    free(text);
    spw_ctx_destroy(ctx);
}

/* Everything fits the budget: nothing streams whichever pipeline runs, so none is timed (no step
 * waits for the device, the splits' layouts are not paid for); the summary says so. When
 * allocations made during each step then push the plan's buffers out (40 MiB taken with
 * spw_malloc mid-step and freed at its end, as PyTorch's tensors under use_allocator), the
 * buffers still fit between steps but the steps evict: the pipelines are timed. */
static void nothing_timed_when_everything_fits(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 8 };
    const size_t sz = 8 * MiB;
    spw_ctx *ctx = test_ctx("budget=80MiB,policy=plan,grow_ahead=0,prefetch=on,emu_link_gbps=1");
    spw_buf *b[NB];
    for (int i = 0; i < NB; i++) assert_ok(spw_buf_create(ctx, sz, SPW_BUF_READ_ONLY, &b[i]));
    long none = 0;
    for (int s = 0; s < 24; s++) {
        void *tmp = NULL;
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            void *d;
            if (s >= 12 && i == NB / 2) assert_ok(spw_malloc(ctx, 40 * MiB, NULL, &tmp));
            assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ, &d));
            assert_ok(spw_launch_host(ctx, NULL, sleep_cb, &none));
            assert_ok(spw_release(b[i], NULL));
        }
        if (tmp) assert_ok(spw_free(ctx, tmp, NULL));
        assert_ok(spw_step_end(ctx));
        if (s == 11) {
            char *text = test_summary(ctx, 0);
            const char *line = strstr(text, "policy plan");
            if (!strstr(text, "everything fits (64.00 MiB of 80.00 MiB): no pipeline timed"))
                fail_msg("want no pipeline timed while everything fits: %.200s", line);
            assert_int_equal(test_stats(ctx).bytes_h2d.total, (int64_t)(NB * sz)); /* each once */
            free(text);
        }
    }
    assert_ok(spw_stream_synchronize(ctx, NULL));
    char *text = test_summary(ctx, 0);
    const char *line = strstr(text, "policy plan");
    if (!strstr(text, "chosen by timing") && !strstr(text, "timing pipelines"))
        fail_msg("want the pipelines timed once the steps evict: %.200s", line);
    free(text);
    for (int i = 0; i < NB; i++) spw_buf_destroy(b[i]);
    spw_ctx_destroy(ctx);
}

/* A step that writes buffers (a forward keeping activations that its backward reads in reverse):
 * the splits, made for one fixed cycle of reads, are not tried, and the two others are. 8
 * read-only weights and 8 written activations of 4 MiB, room for 10 of 16. */
static void splits_not_tried_where_the_step_writes(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NL = 8 };
    spw_ctx *ctx = test_ctx("budget=41MiB,policy=plan,grow_ahead=0,prefetch=on,emu_link_gbps=1");
    spw_buf *w[NL], *a[NL];
    for (int i = 0; i < NL; i++) {
        assert_ok(spw_buf_create(ctx, 4 * MiB, SPW_BUF_READ_ONLY, &w[i]));
        assert_ok(spw_buf_create(ctx, 4 * MiB, 0, &a[i]));
    }
    void *d;
    for (int s = 0; s < 12; s++) {
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NL; i++) {
            assert_ok(spw_acquire(w[i], NULL, SPW_ACCESS_READ, &d));
            assert_ok(spw_acquire(a[i], NULL, SPW_ACCESS_WRITE, &d));
            assert_ok(spw_release(a[i], NULL));
            assert_ok(spw_release(w[i], NULL));
        }
        for (int i = NL - 1; i >= 0; i--) {
            assert_ok(spw_acquire(a[i], NULL, SPW_ACCESS_READ, &d));
            assert_ok(spw_acquire(w[i], NULL, SPW_ACCESS_READ, &d));
            assert_ok(spw_release(w[i], NULL));
            assert_ok(spw_release(a[i], NULL));
        }
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_stream_synchronize(ctx, NULL));
    }
    char *text = test_summary(ctx, 0);
    if (!strstr(text, "chosen by timing") || !strstr(text, "the splits not tried: the step writes buffers"))
        fail_msg("want the pipeline chosen without the splits:\n%s", text);
    free(text);
    spw_ctx_destroy(ctx);
}

/* Steps that each leave their plan (the order of the buffers turns by one every step, as routed
 * experts change from token to token) time nothing; after a few the trials pause, so that such a
 * program's steps do not each end waiting for their device work, and the summary says why. The
 * first step that follows its plan again resumes the trials at the pipeline they paused at. */
static void trials_pause_while_every_step_leaves_its_plan(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    enum { NB = 8 };
    spw_ctx *ctx = test_ctx("budget=41MiB,policy=plan,grow_ahead=0,prefetch=on,emu_link_gbps=1");
    spw_buf *b[NB];
    for (int i = 0; i < NB; i++) assert_ok(spw_buf_create(ctx, 8 * MiB, SPW_BUF_READ_ONLY, &b[i]));
    long none = 0;
    char paused_at[64] = "";
    for (int s = 0; s < 40; s++) {
        int turn = s >= 5 && s < 15 ? s : 0; /* in order, then turning, then in order again */
        assert_ok(spw_step_begin(ctx));
        if (s == 5 || s == 17) { /* the trial this step runs */
            char *text = test_summary(ctx, 0);
            const char *now = strstr(text, "timing pipelines: ");
            if (!now) fail_msg("step %d: want the pipelines being timed: %.300s", s, strstr(text, "policy plan"));
            const char *of = strstr(now, " of 4)");
            assert_non_null(of);
            char here[64];
            snprintf(here, sizeof here, "%.*s", (int)(of - now), now);
            if (s == 5) {
                assert_true(of[-1] > '1'); /* a trial after the first */
                strcpy(paused_at, here);
            } else if (strcmp(here, paused_at)) {
                fail_msg("want the trials resumed at \"%s\", not \"%s\"", paused_at, here);
            }
            free(text);
        }
        for (int i = 0; i < NB; i++) {
            void *d;
            spw_buf *x = b[(i + turn) % NB];
            assert_ok(spw_acquire(x, NULL, SPW_ACCESS_READ, &d));
            assert_ok(spw_launch_host(ctx, NULL, sleep_cb, &none));
            assert_ok(spw_release(x, NULL));
        }
        assert_ok(spw_step_end(ctx));
        if (s == 14) {
            char *text = test_summary(ctx, 0);
            const char *line = strstr(text, "policy plan");
            if (!strstr(text, "pipeline double buffer; the steps leave their plan (10 in a row): no pipeline timed"))
                fail_msg("after 10 steps that left their plan, want the trials paused: %.300s", line);
            free(text);
        }
    }
    assert_ok(spw_stream_synchronize(ctx, NULL));
    char *text = test_summary(ctx, 0);
    if (!strstr(text, "chosen by timing"))
        fail_msg("want the pipelines timed once the steps follow their plan:\n%s", text);
    free(text);
    for (int i = 0; i < NB; i++) spw_buf_destroy(b[i]);
    spw_ctx_destroy(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(pipeline_chosen_by_timing),
        cmocka_unit_test(pipeline_chosen_by_device_time),
        cmocka_unit_test(pipeline_timed_again_when_the_work_changes),
        cmocka_unit_test(splits_not_tried_where_the_step_writes),
        cmocka_unit_test(a_hiccup_in_a_trial_does_not_decide),
        cmocka_unit_test(a_slow_settle_step_ends_its_trial),
        cmocka_unit_test(nothing_timed_when_everything_fits),
        cmocka_unit_test(trials_pause_while_every_step_leaves_its_plan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
