/*
 * The context of an emu development probe (bench/dev/mixed_units.c, sim_units.c): made from a
 * configuration string, its plan pipeline forced to `early` (as the policy's timing may pick it)
 * unless `tune` leaves the choice to the timing. NULL after printing the library's message,
 * prefixed by the probe's name. Internal headers: a probe, not a user of the public API.
 */
#ifndef SPW_BENCH_PROBE_CTX_H
#define SPW_BENCH_PROBE_CTX_H

#include <stdbool.h>
#include <stdio.h>

#include "engine.h"
#include "policy_plan.h"

static inline spw_ctx *probe_ctx(const char *who, const char *conf, bool tune, int early) {
    spw_config *cfg = NULL;
    spw_ctx *ctx = NULL;
    if (spw_config_create(&cfg) || spw_config_parse(cfg, conf) || spw_ctx_create(cfg, &ctx)) {
        fprintf(stderr, "%s: %s\n", who, spw_last_error());
        spw_config_destroy(cfg);
        return NULL;
    }
    spw_config_destroy(cfg);
    if (!tune) ctx->engine->pol->early_max = early;
    return ctx;
}

#endif
