/* spillway: the command-line tool. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} commands[] = {
    {"replay", spw_cmd_replay, "replay an allocation trace through the allocator"},
    {"bench", spw_cmd_bench, "benchmarks: bench alloc | bench stream"},
    {"simulate", spw_cmd_simulate, "run an access trace through the offload engine (emu)"},
    {"probe", spw_cmd_probe, "measure this GPU's memory, links and fallback behaviour"},
    {"run", spw_cmd_run, "run a program with its GPU memory capped: run --budget SIZE -- CMD"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: spillway [--help] [--version] [--help-options] COMMAND [ARGS...]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\n'spillway COMMAND --help' describes a command. Options for the library are read\n"
               "from SPILLWAY_CONF (key=value,...); 'spillway --help-options' lists them.\n");
}

const char *spw_cli_flag_value(const char *cmd, int argc, char **argv, int *i, const char *flag) {
    size_t n = strlen(flag);
    if (argv[*i][n] == '=') return argv[*i] + n + 1;
    if (*i + 1 >= argc) {
        fprintf(stderr, "%s: %s needs a value\n", cmd, flag);
        return NULL;
    }
    return argv[++*i];
}

bool spw_cli_is_flag(const char *arg, const char *flag) {
    size_t n = strlen(flag);
    return !strncmp(arg, flag, n) && (arg[n] == '\0' || arg[n] == '=');
}

void spw_cli_fail(const char *what, spw_status st) {
    const char *msg = spw_last_error();
    fprintf(stderr, "spillway: %s: %s%s%s\n", what, spw_status_str(st), msg[0] ? ": " : "", msg);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("spillway %s\n", spw_version());
        return 0;
    }
    if (!strcmp(cmd, "--help-options")) {
        spw_config_print_help(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(cmd, commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "spillway: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
