/*
 * The end of a timed step: a policy that times its steps on the host (policy=plan trying its
 * pipelines) needs each step to end when its device work does. A caller that waits for every
 * step (a loss read, a token sampled) gives it that already; one that enqueues steps back to back
 * and runs ahead of the device would hand it the time of its enqueueing only, about the same for
 * every pipeline. So while the policy times steps, spw_step_end waits on the host for the last
 * use of every buffer released during the step.
 *
 * How: under the lock, the engine's own wait stream is made to wait for each such buffer's
 * last-use event and records the engine's own event after them; the host then waits for that
 * event without the lock (only engine-owned handles are touched unlocked, so a buffer destroyed
 * meanwhile changes nothing). Best effort: a failed call skips the wait, which costs only the
 * timing's accuracy.
 */
#include "engine.h"

#define OPS(ctx) ((ctx)->backend->ops)
#define BE(ctx) ((ctx)->backend)

static bool wait_handles(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (e->wait_s) return true;
    spw_stream s = NULL;
    spw_event ev = NULL;
    if (OPS(ctx)->stream_create(BE(ctx), &s)) return false;
    if (OPS(ctx)->event_create(BE(ctx), &ev)) {
        OPS(ctx)->stream_destroy(BE(ctx), s);
        return false;
    }
    e->wait_s = s; /* not in events_live, which counts the buffers' events */
    e->wait_ev = ev;
    return true;
}

void spw__step_wait(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!e->streams_ok || !wait_handles(ctx)) {
        spw__error_clear();
        return;
    }
    int waits = 0;
    for (spw_buf *b = e->first; b; b = b->next) {
        if (b->rel_step != e->step || !b->resident || !b->dev_rec) continue;
        if (OPS(ctx)->stream_wait(BE(ctx), e->wait_s, b->ev_dev)) {
            spw__error_clear();
            return;
        }
        waits++;
    }
    if (!waits || OPS(ctx)->event_record(BE(ctx), e->wait_ev, e->wait_s)) {
        spw__error_clear();
        return;
    }
    pthread_mutex_unlock(&ctx->lock);
    if (OPS(ctx)->event_sync(BE(ctx), e->wait_ev)) spw__error_clear();
    pthread_mutex_lock(&ctx->lock);
}

void spw__step_wait_destroy(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!e->wait_s) return;
    OPS(ctx)->stream_destroy(BE(ctx), e->wait_s);
    OPS(ctx)->event_destroy(BE(ctx), e->wait_ev);
    e->wait_s = NULL;
    e->wait_ev = NULL;
}
