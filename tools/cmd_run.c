/* Placeholder until its issue lands: says so and fails. */
#include "cli.h"

int spw_cmd_run(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "spillway: 'run' is not implemented yet\n");
    return 2;
}
