#include "test_util.h"

#include <stdlib.h>
#include <string.h>

int test_on_emu(void) {
    const char *b = getenv("SPW_TEST_BACKEND");
    return !b || strcmp(b, "cuda") != 0;
}

spw_ctx *test_ctx(const char *conf) {
    spw_config *cfg = NULL;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_set(cfg, "backend", test_on_emu() ? "emu" : "cuda"));
    if (conf) assert_ok(spw_config_parse(cfg, conf));
    spw_ctx *ctx = NULL;
    assert_ok(spw_ctx_create(cfg, &ctx));
    spw_config_destroy(cfg);
    return ctx;
}
