/*
 * The probe's measurement sequence, written once against spw_probe_ops (cuda and emu implement
 * it). Order: validated transfers, allocation latencies, the fallback scan, the self-test, the
 * classification. Every copy is validated before it is timed: a fast copy that moved the wrong
 * bytes is a failure, reported in the result (never a number in the table).
 */
#include <stdlib.h>
#include <string.h>

#include "probe.h"

typedef struct meas {
    const spw_probe_ops *ops;
    spw_probe_dev *d;
    const spw_probe_plan *plan;
    spw_probe_result *r;
    spw_probe_progress_fn progress;
    void *pu;
    spw_stream s1, s2;
    spw_event ev[3];
    unsigned char *check_buf; /* pinned, CHECK_BYTES: read-backs of scan chunks */
} meas;

#define CHECK_BYTES 4096
#define SAMPLES 4096

static void tick(meas *m, const char *step, size_t i, size_t n) {
    if (m->progress) m->progress(m->pu, step, i, n);
}

/* ---- patterns: a non-zero fill byte plus SAMPLES stamped 8-byte words that depend on the
 * offset, so a copy that misplaces data fails as surely as one that moves nothing ---- */

static unsigned char fill_byte(uint64_t seed) { return (unsigned char)((seed * 0x9Eu + 0x5Au) | 1u); }

static uint64_t stamp(uint64_t seed, size_t off) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (uint64_t)off;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return x | 1;
}

static size_t sample_off(size_t k, size_t bytes) {
    size_t words = bytes / 8;
    if (k >= SAMPLES) return (words - 1) * 8;
    return k * words / SAMPLES * 8;
}

static void fill_pattern(unsigned char *buf, size_t bytes, uint64_t seed) {
    memset(buf, fill_byte(seed), bytes);
    for (size_t k = 0; k <= SAMPLES; k++) {
        uint64_t v = stamp(seed, sample_off(k, bytes));
        memcpy(buf + sample_off(k, bytes), &v, 8);
    }
}

/* true when the sampled words (and fill bytes between them) match fill_pattern(seed). */
static bool check_pattern(const unsigned char *buf, size_t bytes, uint64_t seed, char *err, size_t len) {
    bool gaps = bytes / 8 / SAMPLES >= 4; /* room for a fill byte between stamps */
    for (size_t k = 0; k <= SAMPLES; k++) {
        size_t off = sample_off(k, bytes);
        uint64_t got, want = stamp(seed, off);
        memcpy(&got, buf + off, 8);
        if (got != want) {
            snprintf(err, len, "word at offset %zu is 0x%016llx, expected 0x%016llx", off,
                     (unsigned long long)got, (unsigned long long)want);
            return false;
        }
        if (gaps && k < SAMPLES && buf[off + 12] != fill_byte(seed)) {
            snprintf(err, len, "byte at offset %zu is 0x%02x, expected 0x%02x", off + 12,
                     buf[off + 12], fill_byte(seed));
            return false;
        }
    }
    return true;
}

/* ---- helpers ---- */

static void set_err(char *dst, size_t len, const char *what) {
    snprintf(dst, len, "%s: %s", what, spw_last_error());
}

static void path_fail(meas *m, spw_probe_path *p, const char *what) {
    set_err(p->error, sizeof p->error, what);
    p->ok = false;
    m->r->ok = false;
}

static void path_invalid(meas *m, spw_probe_path *p, const char *what, const char *detail) {
    snprintf(p->error, sizeof p->error, "VALIDATION FAILED (%s): %s", what, detail);
    p->ok = false;
    p->validated = false;
    m->r->ok = false;
}

/* "1.80 GiB" (messages inside the result; the report prints sizes itself) */
static const char *fmt_gib(char *buf, size_t len, size_t bytes) {
    if (bytes >= SPW_GiB)
        snprintf(buf, len, "%.2f GiB", (double)bytes / (double)SPW_GiB);
    else
        snprintf(buf, len, "%.0f MiB", (double)bytes / (double)SPW_MiB);
    return buf;
}

static double gbps_of(double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e6) : 0; }

/* Time `reps` copies of bytes on s1, one at a time (each waited for, so no queueing effect).
 * mult: bytes counted per copied byte (2 for device to device: read + write). Fills best and
 * median of p and sets ok. */
static spw_status time_copies(meas *m, spw_probe_path *p, void *dst, const void *src, size_t bytes,
                              spw_copy_kind kind, double mult) {
    const spw_probe_ops *o = m->ops;
    double v[64];
    int reps = p->reps < 64 ? p->reps : 64;
    for (int i = 0; i < reps; i++) {
        tick(m, p->label, (size_t)i, (size_t)reps);
        double ms = 0;
        spw_status st = o->event_record(m->d, m->ev[0], m->s1);
        if (!st) st = o->copy_async(m->d, dst, src, bytes, kind, m->s1);
        if (!st) st = o->event_record(m->d, m->ev[1], m->s1);
        if (!st) st = o->event_elapsed_ms(m->d, m->ev[0], m->ev[1], &ms);
        if (st) return st;
        v[i] = gbps_of(mult * (double)bytes, ms);
    }
    p->best_gbps = 0;
    for (int i = 0; i < reps; i++)
        if (v[i] > p->best_gbps) p->best_gbps = v[i];
    p->median_gbps = spw_probe_median(v, (size_t)reps);
    p->ok = p->best_gbps > 0;
    if (!p->ok) snprintf(p->error, sizeof p->error, "timing gave no positive bandwidth");
    return SPW_OK;
}

/* One both-directions round: H2D of hp_a -> d_a on s1 and D2H of d_b -> hp_b on s2, both in
 * flight at once, started by one event on s1 that s2 waits for. ms = until the later finishes. */
static spw_status both_ways_once(meas *m, void *d_a, const void *hp_a, void *hp_b, const void *d_b,
                                 size_t bytes, double *ms) {
    const spw_probe_ops *o = m->ops;
    double t1 = 0, t2 = 0;
    spw_status st = o->event_record(m->d, m->ev[0], m->s1);
    if (!st) st = o->stream_wait(m->d, m->s2, m->ev[0]);
    if (!st) st = o->copy_async(m->d, d_a, hp_a, bytes, SPW_COPY_H2D, m->s1);
    if (!st) st = o->copy_async(m->d, hp_b, d_b, bytes, SPW_COPY_D2H, m->s2);
    if (!st) st = o->event_record(m->d, m->ev[1], m->s1);
    if (!st) st = o->event_record(m->d, m->ev[2], m->s2);
    if (!st) st = o->event_elapsed_ms(m->d, m->ev[0], m->ev[1], &t1);
    if (!st) st = o->event_elapsed_ms(m->d, m->ev[0], m->ev[2], &t2);
    *ms = t1 > t2 ? t1 : t2;
    return st;
}

/* ---- 1. transfers ---- */

static void measure_paths(meas *m) {
    const spw_probe_ops *o = m->ops;
    const spw_probe_plan *pl = m->plan;
    spw_probe_result *r = m->r;
    spw_probe_path *P = r->paths;
    size_t S = pl->xfer_bytes;
    unsigned char *hp_a = NULL, *hp_b = NULL, *hm = NULL;
    void *d_a = NULL, *d_b = NULL;
    char err[192];
    spw_status st;

    for (int i = 0; i < SPW_PATH_COUNT_; i++) {
        P[i].ran = true;
        P[i].bytes = S;
        P[i].reps = i == SPW_PATH_D2D ? pl->reps_d2d
                    : (i == SPW_PATH_PAGEABLE_H2D || i == SPW_PATH_PAGEABLE_D2H) ? pl->reps_pageable
                                                                                : pl->reps_pinned;
    }
    double link = r->link.known ? r->link.gbps : 0;
    P[SPW_PATH_PINNED_H2D].theoretical_gbps = P[SPW_PATH_PINNED_D2H].theoretical_gbps = link;
    P[SPW_PATH_PAGEABLE_H2D].theoretical_gbps = P[SPW_PATH_PAGEABLE_D2H].theoretical_gbps = link;
    P[SPW_PATH_BOTH].theoretical_gbps = 2 * link;
    P[SPW_PATH_D2D].theoretical_gbps = r->vram_theoretical_gbps;

    tick(m, "allocating transfer buffers", 0, 1);
    void *ta = NULL, *tb = NULL;
    st = o->host_alloc(m->d, S, &ta);
    if (!st) hp_a = ta;
    if (!st) st = o->host_alloc(m->d, S, &tb);
    if (!st) hp_b = tb;
    if (!st) st = o->dev_alloc(m->d, S, &d_a);
    if (!st) st = o->dev_alloc(m->d, S, &d_b);
    if (!st && !(hm = malloc(S))) st = spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "malloc(%zu) for the pageable buffer failed", S);
    if (st) {
        for (int i = 0; i < SPW_PATH_COUNT_; i++) path_fail(m, &P[i], "allocating transfer buffers");
        goto out;
    }

    /* pinned: validate by a round trip (H2D then D2H, compared with the source), then time */
    {
        spw_probe_path *h = &P[SPW_PATH_PINNED_H2D], *dh = &P[SPW_PATH_PINNED_D2H];
        tick(m, "pinned copies", 0, 1);
        fill_pattern(hp_a, S, 1);
        memset(hp_b, 0, S);
        st = o->memset_async(m->d, d_a, 0, S, m->s1);
        if (!st) st = o->copy_async(m->d, d_a, hp_a, S, SPW_COPY_H2D, m->s1);
        if (!st) st = o->copy_async(m->d, hp_b, d_a, S, SPW_COPY_D2H, m->s1);
        if (!st) st = o->stream_sync(m->d, m->s1);
        if (st) {
            path_fail(m, h, "pinned round trip");
            path_fail(m, dh, "pinned round trip");
        } else if (!check_pattern(hp_b, S, 1, err, sizeof err)) {
            path_invalid(m, h, "pinned host -> device -> host round trip", err);
            path_invalid(m, dh, "pinned host -> device -> host round trip", err);
        } else {
            h->validated = dh->validated = true;
            if (time_copies(m, h, d_a, hp_a, S, SPW_COPY_H2D, 1)) path_fail(m, h, "timing");
            if (time_copies(m, dh, hp_b, d_a, S, SPW_COPY_D2H, 1)) path_fail(m, dh, "timing");
        }
    }

    /* device to device: d_a (loaded from hp_a) -> d_b, read back, compared; counts read + write */
    {
        spw_probe_path *p = &P[SPW_PATH_D2D];
        tick(m, "device-to-device copies", 0, 1);
        memset(hp_b, 0, S);
        st = o->copy_async(m->d, d_a, hp_a, S, SPW_COPY_H2D, m->s1);
        if (!st) st = o->memset_async(m->d, d_b, 0, S, m->s1);
        if (!st) st = o->copy_async(m->d, d_b, d_a, S, SPW_COPY_D2D, m->s1);
        if (!st) st = o->copy_async(m->d, hp_b, d_b, S, SPW_COPY_D2H, m->s1);
        if (!st) st = o->stream_sync(m->d, m->s1);
        if (st) {
            path_fail(m, p, "device-to-device validation copy");
        } else if (!check_pattern(hp_b, S, 1, err, sizeof err)) {
            path_invalid(m, p, "device to device", err);
        } else {
            p->validated = true;
            if (time_copies(m, p, d_b, d_a, S, SPW_COPY_D2D, 2)) path_fail(m, p, "timing");
        }
    }

    /* both directions at once: d_b holds seed 3, hp_a seed 2; after one round hp_b must hold
     * seed 3 and d_a seed 2 */
    {
        spw_probe_path *p = &P[SPW_PATH_BOTH];
        tick(m, "bidirectional copies", 0, 1);
        fill_pattern(hp_b, S, 3);
        st = o->copy_async(m->d, d_b, hp_b, S, SPW_COPY_H2D, m->s1);
        if (!st) st = o->memset_async(m->d, d_a, 0, S, m->s1);
        if (!st) st = o->stream_sync(m->d, m->s1);
        if (!st) {
            fill_pattern(hp_a, S, 2);
            memset(hp_b, 0, S);
            double ms;
            st = both_ways_once(m, d_a, hp_a, hp_b, d_b, S, &ms);
        }
        bool good = false;
        if (st) {
            path_fail(m, p, "bidirectional validation round");
        } else if (!check_pattern(hp_b, S, 3, err, sizeof err)) {
            path_invalid(m, p, "device -> host half of both directions", err);
        } else {
            st = o->copy_async(m->d, hp_b, d_a, S, SPW_COPY_D2H, m->s1);
            if (!st) st = o->stream_sync(m->d, m->s1);
            if (st)
                path_fail(m, p, "reading back the host -> device half");
            else if (!check_pattern(hp_b, S, 2, err, sizeof err))
                path_invalid(m, p, "host -> device half of both directions", err);
            else
                good = true;
        }
        if (good) {
            p->validated = true;
            double v[64];
            int reps = p->reps < 64 ? p->reps : 64, i;
            for (i = 0; i < reps; i++) {
                tick(m, p->label, (size_t)i, (size_t)reps);
                double ms = 0;
                if ((st = both_ways_once(m, d_a, hp_a, hp_b, d_b, S, &ms))) break;
                v[i] = gbps_of(2.0 * (double)S, ms);
            }
            if (st) {
                path_fail(m, p, "timing");
            } else {
                p->best_gbps = 0;
                for (i = 0; i < reps; i++)
                    if (v[i] > p->best_gbps) p->best_gbps = v[i];
                p->median_gbps = spw_probe_median(v, (size_t)reps);
                p->ok = p->best_gbps > 0;
            }
        }
    }

    /* pageable: malloc'd host memory, staged by the driver */
    {
        spw_probe_path *h = &P[SPW_PATH_PAGEABLE_H2D], *dh = &P[SPW_PATH_PAGEABLE_D2H];
        tick(m, "pageable copies", 0, 1);
        fill_pattern(hm, S, 4);
        memset(hp_b, 0, S);
        st = o->memset_async(m->d, d_a, 0, S, m->s1);
        if (!st) st = o->copy_async(m->d, d_a, hm, S, SPW_COPY_H2D, m->s1);
        if (!st) st = o->copy_async(m->d, hp_b, d_a, S, SPW_COPY_D2H, m->s1);
        if (!st) st = o->stream_sync(m->d, m->s1);
        if (st) {
            path_fail(m, h, "pageable host -> device validation");
        } else if (!check_pattern(hp_b, S, 4, err, sizeof err)) {
            path_invalid(m, h, "pageable host -> device", err);
        } else {
            h->validated = true;
        }
        if (h->validated) {
            memset(hm, 0, S);
            st = o->copy_async(m->d, hm, d_a, S, SPW_COPY_D2H, m->s1);
            if (!st) st = o->stream_sync(m->d, m->s1);
            if (st)
                path_fail(m, dh, "pageable device -> host validation");
            else if (!check_pattern(hm, S, 4, err, sizeof err))
                path_invalid(m, dh, "device -> pageable host", err);
            else
                dh->validated = true;
        } else {
            snprintf(dh->error, sizeof dh->error, "not run: the pageable host -> device copy failed");
        }
        if (h->validated && time_copies(m, h, d_a, hm, S, SPW_COPY_H2D, 1)) path_fail(m, h, "timing");
        if (dh->validated && time_copies(m, dh, hm, d_a, S, SPW_COPY_D2H, 1)) path_fail(m, dh, "timing");
    }

out:
    /* frees are attempted even after errors; a failing free is reported on the first path */
    if (hp_a && o->host_free(m->d, hp_a)) path_fail(m, &P[0], "freeing transfer buffers");
    if (hp_b && o->host_free(m->d, hp_b)) path_fail(m, &P[0], "freeing transfer buffers");
    if (d_a && o->dev_free(m->d, d_a)) path_fail(m, &P[0], "freeing transfer buffers");
    if (d_b && o->dev_free(m->d, d_b)) path_fail(m, &P[0], "freeing transfer buffers");
    free(hm);
}

/* ---- 2. allocation latency: allocate + free, as the design table measures it ---- */

static void measure_latency(meas *m, spw_probe_latency *l, bool host, size_t bytes, int reps) {
    const spw_probe_ops *o = m->ops;
    double v[64] = {0};
    l->ran = true;
    l->bytes = bytes;
    l->reps = reps = reps < 64 ? reps : 64;
    l->api = host ? o->host_alloc_api : o->dev_alloc_api;
    for (int i = -1; i < reps; i++) { /* i == -1: warm-up, not recorded */
        tick(m, host ? "pinned allocation latency" : "device allocation latency", (size_t)(i + 1),
             (size_t)reps + 1);
        void *p = NULL;
        uint64_t t0 = spw__now_ns();
        spw_status st = host ? o->host_alloc(m->d, bytes, &p) : o->dev_alloc(m->d, bytes, &p);
        if (!st) st = host ? o->host_free(m->d, p) : o->dev_free(m->d, p);
        uint64_t t1 = spw__now_ns();
        if (st) {
            set_err(l->error, sizeof l->error, host ? "pinned allocation" : "device allocation");
            m->r->ok = false;
            return;
        }
        if (i >= 0) v[i] = (double)(t1 - t0) / 1e3;
    }
    l->median_us = spw_probe_median(v, (size_t)reps);
    l->min_us = v[0];
    for (int i = 1; i < reps; i++)
        if (v[i] < l->min_us) l->min_us = v[i];
    l->ok = true;
}

/* ---- 2b. pinnable host memory: pinned allocations of pin_chunk held at once, until the system
 * refuses one or pin_cap is held. A system that limits pinned memory (WSL2) shows here: host
 * copies past the limit are pageable, and copies from them are slower and block the caller. A
 * refusal is a finding, not a failure of the probe. ---- */

static void measure_pinnable(meas *m) {
    const spw_probe_ops *o = m->ops;
    spw_probe_result *r = m->r;
    size_t chunk = m->plan->pin_chunk, n = chunk ? m->plan->pin_cap / chunk : 0;
    if (!n) return;
    void **held = calloc(n, sizeof *held);
    if (!held) return;
    r->pin_ran = true;
    r->pin_chunk = chunk;
    r->pin_cap = n * chunk;
    size_t i = 0;
    for (; i < n; i++) {
        tick(m, "pinnable host memory", i, n);
        if (o->host_alloc(m->d, chunk, &held[i])) {
            set_err(r->pin_error, sizeof r->pin_error, "pinned allocation");
            break;
        }
    }
    spw__error_clear();
    r->pinnable_bytes = i * chunk;
    r->pin_capped = i == n;
    while (i--)
        if (o->host_free(m->d, held[i])) r->ok = false;
    free(held);
}

/* ---- 3. the fallback scan ---- */

/* Read `bytes` at base into the VRAM scratch buffer, window by window (start, middle, end), and
 * return the slowest window's best rate in *gbps: bytes read per second, each byte counted once.
 * When fill is set the chunk is first filled with `b` on the device (the whole chunk when the
 * plan says so: committing every page is what a real workload does and what reveals WDDM
 * fallback); otherwise the caller filled it. Validates the last window's bytes in scratch. */
static spw_status measure_chunk(meas *m, void *scratch, unsigned char *base, size_t bytes,
                                unsigned char b, bool fill, double *gbps, bool *validated) {
    const spw_probe_ops *o = m->ops;
    const spw_probe_plan *pl = m->plan;
    size_t W = SPW_MIN(pl->window_bytes, bytes);
    int nw = pl->windows_per_chunk < 1 ? 1 : pl->windows_per_chunk > 3 ? 3 : pl->windows_per_chunk;
    size_t off[3] = {0, SPW_ALIGN_DOWN((bytes - W) / 2, 4096), bytes - W};
    if (bytes == W) nw = 1;
    spw_status st = SPW_OK;
    *gbps = 0;
    *validated = false;

    if (fill) {
        if (pl->touch_whole_chunk)
            st = o->memset_async(m->d, base, b, bytes, m->s1);
        for (int w = 0; w < nw && !st && !pl->touch_whole_chunk; w++)
            st = o->memset_async(m->d, base + off[w], b, W, m->s1);
        if (st) return st;
    }
    /* warm-up (and the fill's completion) outside the timing */
    st = o->copy_async(m->d, scratch, base + off[0], W, SPW_COPY_D2D, m->s1);
    if (!st) st = o->stream_sync(m->d, m->s1);
    double slowest = 0;
    for (int w = 0; w < nw && !st; w++) {
        double best = 0;
        for (int rep = 0; rep < pl->reps_window && !st; rep++) {
            double ms = 0;
            st = o->event_record(m->d, m->ev[0], m->s1);
            if (!st) st = o->copy_async(m->d, scratch, base + off[w], W, SPW_COPY_D2D, m->s1);
            if (!st) st = o->event_record(m->d, m->ev[1], m->s1);
            if (!st) st = o->event_elapsed_ms(m->d, m->ev[0], m->ev[1], &ms);
            double g = gbps_of((double)W, ms);
            if (g > best) best = g;
        }
        if (w == 0 || best < slowest) slowest = best;
    }
    if (st) return st;
    /* the scratch now holds the last window: its first and last bytes must be b */
    memset(m->check_buf, 0, CHECK_BYTES);
    size_t half = SPW_MIN((size_t)CHECK_BYTES / 2, W);
    st = o->copy_async(m->d, m->check_buf, scratch, half, SPW_COPY_D2H, m->s1);
    if (!st) st = o->copy_async(m->d, m->check_buf + half, (unsigned char *)scratch + W - half, half, SPW_COPY_D2H, m->s1);
    if (!st) st = o->stream_sync(m->d, m->s1);
    if (st) return st;
    bool okv = true;
    for (size_t i = 0; i < 2 * half; i++) okv &= m->check_buf[i] == b;
    *validated = okv;
    *gbps = slowest;
    return SPW_OK;
}

static unsigned char chunk_fill(size_t i) { return (unsigned char)(0x21 + i % 200); } /* != previous */

/* Confirm pass, while the chunks are still held: a chunk that looks like system memory is read
 * again, up to twice, each time right after a VRAM reference chunk (paired), before it is
 * believed. Contention that came and went during the scan (another process's work on the GPU, a
 * preempted emu worker) slows both reads of a pair alike; real fallback keeps its chunk far
 * below its partner. When the pair says "as fast as VRAM", the chunk's figure becomes its
 * paired read scaled to the reference's original conditions (gbps_i x ref / gbps_ref now):
 * the bandwidth it would have shown in the reference's place. The best figure is kept. */
static spw_status confirm_flagged(meas *m, void *scratch, void **ptrs, size_t n) {
    spw_probe_result *r = m->r;
    double *s = malloc(n * sizeof *s);
    spw_chunk_verdict *v = malloc(n * sizeof *v);
    spw_status st = SPW_OK;
    if (!s || !v) {
        free(s);
        free(v);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "out of host memory confirming %zu chunks", n);
    }
    for (int round = 0; round < 2 && !st; round++) {
        for (size_t i = 0; i < n; i++) s[i] = r->chunks[i].gbps;
        spw_probe_classify(s, n, SPW_DETECT_THRESHOLD, v);
        size_t ref = 0; /* partner: the first chunk that classified as VRAM */
        while (ref < n && v[ref].cls != SPW_CHUNK_VRAM) ref++;
        for (size_t i = 0; i < n && !st && ref < n; i++) {
            if (v[i].cls != SPW_CHUNK_SYSMEM) continue;
            tick(m, "confirming slow chunks", i, n);
            double g0 = 0, g = 0;
            bool valid0 = false, valid = false;
            st = measure_chunk(m, scratch, ptrs[ref], r->chunks[ref].bytes, chunk_fill(ref), false, &g0, &valid0);
            if (!st) st = measure_chunk(m, scratch, ptrs[i], r->chunks[i].bytes, chunk_fill(i), false, &g, &valid);
            if (st) break;
            r->chunks[i].remeasured++;
            if (!valid || !valid0 || !(g0 > 0)) continue;
            double scaled = g >= SPW_DETECT_THRESHOLD * g0 ? g * r->chunks[ref].gbps / g0 : g;
            if (scaled > r->chunks[i].gbps) r->chunks[i].gbps = scaled;
        }
    }
    free(s);
    free(v);
    return st;
}

static void measure_scan(meas *m, void *scratch) {
    const spw_probe_ops *o = m->ops;
    const spw_probe_plan *pl = m->plan;
    spw_probe_result *r = m->r;
    size_t free_b = 0, total_b = 0;
    char b1[64], b2[64];
    r->scan_ran = true;
    r->scan_ok = true;
    r->windows_per_chunk = pl->windows_per_chunk;

    if (o->mem_info(m->d, &free_b, &total_b)) {
        set_err(r->scan_error, sizeof r->scan_error, "memory info");
        r->scan_ok = false;
        return;
    }
    size_t avail = free_b > pl->margin_bytes ? free_b - pl->margin_bytes : 0;
    size_t limit;
    if (pl->max_mem) {
        limit = SPW_MIN(pl->max_mem, avail);
        snprintf(r->max_mem_how, sizeof r->max_mem_how, "--max-mem %s%s",
                 spw_probe_size_arg(b1, sizeof b1, pl->max_mem),
                 limit < pl->max_mem ? ", clamped to free memory" : "");
    } else {
        limit = SPW_MIN((size_t)((double)free_b * pl->max_mem_fraction), avail);
        snprintf(r->max_mem_how, sizeof r->max_mem_how, "%.0f%% of free", pl->max_mem_fraction * 100);
    }
    limit = SPW_ALIGN_DOWN(limit, 2 * SPW_MiB);
    size_t chunk = SPW_ALIGN_UP(SPW_MAX(pl->min_chunk, limit / (pl->chunk_divisor ? pl->chunk_divisor : 1)), 2 * SPW_MiB);
    if (chunk > limit) chunk = limit;
    size_t min_piece = SPW_MIN(64 * SPW_MiB, chunk);
    r->max_mem = limit;
    r->chunk_bytes = chunk;
    r->window_bytes = SPW_MIN(pl->window_bytes, chunk);
    if (chunk == 0 || limit < 2 * SPW_MiB) {
        snprintf(r->scan_stop, sizeof r->scan_stop, "nothing to scan: %s free",
                 fmt_gib(b1, sizeof b1, free_b));
        return;
    }

    size_t cap = limit / chunk + 2;
    void **ptrs = calloc(cap, sizeof *ptrs);
    r->chunks = calloc(cap, sizeof *r->chunks);
    if (!ptrs || !r->chunks) {
        snprintf(r->scan_error, sizeof r->scan_error, "out of host memory for %zu chunk records", cap);
        r->scan_ok = false;
        free(ptrs);
        return;
    }
    size_t done = 0, n = 0;
    snprintf(r->scan_stop, sizeof r->scan_stop, "limit reached (%s)", fmt_gib(b1, sizeof b1, limit));
    while (n < cap) {
        size_t want = SPW_ALIGN_DOWN(SPW_MIN(chunk, limit - done), 2 * SPW_MiB);
        if (want < min_piece) break;
        tick(m, "fallback scan", n, limit / chunk);
        /* never more than free, checked live: other processes may be allocating too */
        if (o->mem_info(m->d, &free_b, &total_b)) {
            set_err(r->scan_error, sizeof r->scan_error, "memory info during the scan");
            r->scan_ok = false;
            break;
        }
        if (free_b < pl->margin_bytes + want) {
            want = free_b > pl->margin_bytes ? SPW_ALIGN_DOWN(free_b - pl->margin_bytes, 2 * SPW_MiB) : 0;
            if (want < min_piece) {
                snprintf(r->scan_stop, sizeof r->scan_stop, "free memory exhausted after %s (%s free)",
                         fmt_gib(b1, sizeof b1, done), fmt_gib(b2, sizeof b2, free_b));
                break;
            }
        }
        if (o->dev_alloc(m->d, want, &ptrs[n])) {
            /* running out is an answer, not an error */
            snprintf(r->scan_stop, sizeof r->scan_stop, "allocation refused after %s: %.120s",
                     fmt_gib(b1, sizeof b1, done), spw_last_error());
            ptrs[n] = NULL;
            break;
        }
        spw_probe_chunk *c = &r->chunks[n];
        c->bytes = want;
        unsigned char b = chunk_fill(n);
        n++;
        if (measure_chunk(m, scratch, ptrs[n - 1], want, b, true, &c->gbps, &c->validated)) {
            set_err(r->scan_error, sizeof r->scan_error, "measuring a chunk");
            r->scan_ok = false;
            break;
        }
        if (!c->validated) {
            snprintf(r->scan_error, sizeof r->scan_error,
                     "VALIDATION FAILED: chunk %zu read into scratch did not hold its fill byte 0x%02x", n - 1, b);
            r->scan_ok = false;
        }
        done += want;
    }
    r->nchunks = n;
    r->scanned_bytes = done;
    if (r->scan_ok && n > 0 && confirm_flagged(m, scratch, ptrs, n)) {
        set_err(r->scan_error, sizeof r->scan_error, "re-reading slow chunks");
        r->scan_ok = false;
    }
    for (size_t i = n; i-- > 0;)
        if (ptrs[i] && o->dev_free(m->d, ptrs[i]) && r->scan_ok) {
            set_err(r->scan_error, sizeof r->scan_error, "freeing scan chunks");
            r->scan_ok = false;
        }
    free(ptrs);
    if (!r->scan_ok) r->ok = false;
}

/* ---- 4. the self-test: mapped pinned host memory, read through its device pointer exactly as
 * a scan chunk is read; it must come out as system memory ---- */

static void measure_selftest(meas *m, void *scratch) {
    const spw_probe_ops *o = m->ops;
    spw_probe_result *r = m->r;
    void *host = NULL, *dev = NULL;
    size_t bytes = m->plan->selftest_bytes;
    r->selftest_ran = true;
    r->selftest_bytes = bytes;
    tick(m, "detector self-test", 0, 1);
    if (o->mapped_alloc(m->d, bytes, &host, &dev)) {
        set_err(r->selftest_error, sizeof r->selftest_error, "mapped pinned allocation");
        return;
    }
    const unsigned char b = 0xC3;
    memset(host, b, bytes);
    bool validated = false;
    if (measure_chunk(m, scratch, dev, bytes, b, false, &r->selftest_gbps, &validated))
        set_err(r->selftest_error, sizeof r->selftest_error, "reading the mapped chunk");
    else if (!validated)
        snprintf(r->selftest_error, sizeof r->selftest_error,
                 "VALIDATION FAILED: the mapped chunk read into scratch did not hold 0x%02x", b);
    if (o->mapped_free(m->d, host) && !r->selftest_error[0])
        set_err(r->selftest_error, sizeof r->selftest_error, "freeing the mapped chunk");
    if (r->selftest_error[0]) r->selftest_gbps = 0;
}

static void classify(spw_probe_result *r) {
    size_t n = r->nchunks;
    double *series = malloc((n + 1) * sizeof *series);
    spw_chunk_verdict *v = malloc((n + 1) * sizeof *v);
    if (!series || !v) {
        free(series);
        free(v);
        snprintf(r->scan_error, sizeof r->scan_error, "out of host memory classifying %zu chunks", n);
        r->scan_ok = r->ok = false;
        return;
    }
    for (size_t i = 0; i < n; i++) series[i] = r->chunks[i].gbps;
    /* The self-test goes last: it cannot move the reference, which comes from leading chunks. */
    series[n] = r->selftest_gbps;
    r->reference_gbps = spw_probe_classify(series, n + 1, SPW_DETECT_THRESHOLD, v);
    bool before = true;
    for (size_t i = 0; i < n; i++) {
        r->chunks[i].v = v[i];
        if (v[i].cls == SPW_CHUNK_SYSMEM) r->flagged++;
        if (v[i].cls != SPW_CHUNK_VRAM) before = false;
        if (before) r->usable_bytes += r->chunks[i].bytes;
    }
    r->fallback_detected = r->flagged > 0;
    r->selftest = v[n];
    if (r->selftest_ran && r->selftest_error[0]) {
        r->selftest.cls = SPW_CHUNK_INVALID;
        snprintf(r->selftest.reason, sizeof r->selftest.reason, "not measured");
    } else if (r->selftest_ran && n == 0) {
        r->selftest.cls = SPW_CHUNK_INVALID;
        snprintf(r->selftest.reason, sizeof r->selftest.reason, "no VRAM chunk was measured to compare with");
    }
    r->selftest_passed = r->selftest_ran && r->selftest.cls == SPW_CHUNK_SYSMEM;
    free(series);
    free(v);
}

void spw_probe_measure(const spw_probe_ops *ops, spw_probe_dev *d, const spw_probe_plan *plan,
                       spw_probe_result *r, spw_probe_progress_fn progress, void *pu) {
    meas m = {.ops = ops, .d = d, .plan = plan, .r = r, .progress = progress, .pu = pu};
    int nev = 0;
    void *scratch = NULL, *cb = NULL;
    spw_status st = ops->stream_create(d, &m.s1);
    if (!st) st = ops->stream_create(d, &m.s2);
    for (; !st && nev < 3; nev++) st = ops->event_create(d, &m.ev[nev]);
    if (st) {
        set_err(r->scan_error, sizeof r->scan_error, "creating streams and events");
        r->ok = r->scan_ok = false;
        r->scan_ran = true;
        goto out;
    }

    measure_paths(&m);
    measure_latency(&m, &r->lat[SPW_LAT_DEV_SMALL], false, plan->lat_small_bytes, plan->reps_lat);
    measure_latency(&m, &r->lat[SPW_LAT_DEV_LARGE], false, plan->xfer_bytes, plan->reps_lat);
    measure_latency(&m, &r->lat[SPW_LAT_PINNED], true, plan->host_lat_bytes, plan->reps_host_lat);
    measure_pinnable(&m);

    /* The scratch buffer is allocated before any chunk, while the device is least full, so it
     * is VRAM if anything is; every chunk is read into it. */
    st = ops->dev_alloc(d, plan->window_bytes, &scratch);
    if (!st) st = ops->host_alloc(d, CHECK_BYTES, &cb);
    if (st) {
        set_err(r->scan_error, sizeof r->scan_error, "allocating the scan's scratch buffers");
        r->ok = r->scan_ok = false;
        r->scan_ran = true;
    } else {
        m.check_buf = cb;
        measure_scan(&m, scratch);
        measure_selftest(&m, scratch);
        classify(r);
    }
    r->recommended_budget = spw_probe_recommend_budget(r->usable_bytes);
    /* On a real GPU a self-test that is not flagged means the detector cannot be trusted. */
    if (!r->selftest_passed && !r->emulated) r->ok = false;
    if (scratch && ops->dev_free(d, scratch)) r->ok = false;
    if (cb && ops->host_free(d, cb)) r->ok = false;
out:
    for (int i = 0; i < nev; i++)
        if (m.ev[i]) ops->event_destroy(d, m.ev[i]);
    if (m.s2) ops->stream_destroy(d, m.s2);
    if (m.s1) ops->stream_destroy(d, m.s1);
    tick(&m, NULL, 0, 0);
}
