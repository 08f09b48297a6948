/* The spillway command-line tool: one function per subcommand, dispatched by main.c. */
#ifndef SPW_CLI_H
#define SPW_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "spillway.h"

/* Each returns the process exit status: 0 success, 1 failure of the work, 2 bad usage. */
int spw_cmd_replay(int argc, char **argv);
int spw_cmd_bench(int argc, char **argv);     /* bench alloc | bench stream */
int spw_cmd_simulate(int argc, char **argv);
int spw_cmd_probe(int argc, char **argv);
int spw_cmd_run(int argc, char **argv);

/* bench subcommands, defined in their own files */
int spw_bench_alloc(int argc, char **argv);
int spw_bench_stream(int argc, char **argv);

/* Value of a flag given as "--flag VALUE" or "--flag=VALUE", advancing *i past it; NULL, with a
 * message naming the command, when the value is missing. */
const char *spw_cli_flag_value(const char *cmd, int argc, char **argv, int *i, const char *flag);
/* arg is the flag, alone or as "--flag=VALUE". */
bool spw_cli_is_flag(const char *arg, const char *flag);

/* Print "spillway: <msg>" plus spw_last_error() to stderr. */
void spw_cli_fail(const char *what, spw_status st);

#endif
