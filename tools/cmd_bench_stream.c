/* Placeholder until the offload engine lands: says so and fails. */
#include "cli.h"

int spw_bench_stream(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "spillway: 'bench stream' is not implemented yet\n");
    return 2;
}
