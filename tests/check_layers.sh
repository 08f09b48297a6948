#!/bin/sh
# Checks that the library's layers point down, on the object files of the build.
# usage: check_layers.sh LIST [SRCDIR]
#   LIST: a file naming one object file a line. SRCDIR: the source tree; with it, the headers
#   each object was compiled with (its compiler depfile, OBJECT.d) are checked too.
#
# For each rule "LOWER : UPPER", no object of LOWER may reference a symbol that an object of
# UPPER defines. Names are object basenames without ".c.o"/".o"; a trailing * matches a prefix.
# The layers, from the bottom: error, options, stats and the backends; the arena and the host
# pool (handed their counters and budget); the context's device memory (ctx.c); the offload
# engine (buffer.c, residency.c, copy.c, ...), handed its policy; the policies; at the top the
# composition (ctx_create.c), the PyTorch entry points, and the tools' code (trace, access,
# oracle: spillway_tools). A lower layer that must reach up (memory pressure) calls a callback
# the upper one registered; the engine reaches its policy through the table it is handed.
set -eu
list=$1
srcdir=${2:-}
[ -s "$list" ] || { echo "check_layers: no object list at $list" >&2; exit 2; }

RULES='
arena arena_trim arena_inspect arena_window hostmem copy backend backend_emu emu_stream backend_cuda backend_cuda_vmm error options stats : ctx ctx_create buffer residency prefetch_thread step_wait policy_* torch_alloc trace access oracle
ctx : ctx_create buffer residency copy hostmem prefetch_thread step_wait trace_events policy_* torch_alloc trace access oracle
buffer residency copy hostmem prefetch_thread step_wait trace_events : ctx_create policy_* torch_alloc trace access oracle
'

# INCLUDES: "LOWER : HEADERS": no object of LOWER is compiled with one of these headers of the
# source tree (directly or through another header).
INCLUDES='
arena arena_trim arena_inspect arena_window hostmem backend backend_emu emu_stream backend_cuda backend_cuda_vmm error options stats : ctx.h engine.h policy.h policy_plan.h spillway_torch.h trace.h access.h oracle.h
ctx : engine.h policy.h policy_plan.h hostmem.h spillway_torch.h trace.h access.h oracle.h
'

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# defs: "object symbol" for every global symbol an object defines
while read -r o; do
  [ -n "$o" ] || continue
  [ -f "$o" ] || { echo "check_layers: missing object $o" >&2; exit 2; }
  n=$(basename "$o"); n=${n%.o}; n=${n%.c}
  echo "$n $o" >> "$tmp/objs"
  nm -g --defined-only "$o" | awk -v n="$n" 'NF >= 3 { print n, $3 }' >> "$tmp/defs"
done < "$list"
[ -s "$tmp/objs" ] || { echo "check_layers: empty object list" >&2; exit 2; }

matches() { # matches NAME PATTERN...
  name=$1; shift
  for p in "$@"; do
    case $p in
      *\*) case $name in "${p%\*}"*) return 0 ;; esac ;;
      *) [ "$name" = "$p" ] && return 0 ;;
    esac
  done
  return 1
}

echo "$RULES" | while IFS= read -r rule; do
  [ -n "$rule" ] || continue
  lower=${rule%%:*}
  upper=${rule#*:}
  # shellcheck disable=SC2086
  awk '{ print $1 }' "$tmp/defs" | sort -u | while read -r n; do
    if matches "$n" $upper; then echo "$n"; fi
  done > "$tmp/upper"
  awk 'NR == FNR { up[$1] = 1; next } ($1 in up) { print $2, $1 }' "$tmp/upper" "$tmp/defs" > "$tmp/updefs"
  while read -r n o; do
    # shellcheck disable=SC2086
    matches "$n" $lower || continue
    nm -u "$o" | awk '{ print $NF }' | sort -u > "$tmp/undef"
    awk -v n="$n" 'NR == FNR { u[$1] = 1; next } ($1 in u) { printf "layers: %s calls up into %s: %s\n", n, $2, $1 }' \
      "$tmp/undef" "$tmp/updefs"
  done < "$tmp/objs"
done > "$tmp/report"

if [ -n "$srcdir" ]; then
  echo "$INCLUDES" | while IFS= read -r rule; do
    [ -n "$rule" ] || continue
    lower=${rule%%:*}
    headers=${rule#*:}
    while read -r n o; do
      # shellcheck disable=SC2086
      matches "$n" $lower || continue
      [ -f "$o.d" ] || { echo "layers: no depfile $o.d (headers unchecked)"; continue; }
      tr ' \\' '\n\n' < "$o.d" | awk -v d="$srcdir/" 'index($0, d) == 1 { r = substr($0, length(d) + 1); if (r ~ /^(src|include)\/[^\/]+\.h$/) { sub(/.*\//, "", r); print r } }' |
        sort -u |
        while read -r h; do
          # shellcheck disable=SC2086
          if matches "$h" $headers; then echo "layers: $n includes $h"; fi
        done
    done < "$tmp/objs"
  done >> "$tmp/report"
fi

if [ -s "$tmp/report" ]; then
  cat "$tmp/report"
  echo "layers: $(wc -l < "$tmp/report") problem(s) (see the rules in $0)"
  exit 1
fi
echo "layers: $(wc -l < "$tmp/objs") objects, no call up${srcdir:+, no header from above}"
