#!/usr/bin/env bash
# Where the link idles: nsys timeline of one bench stream case (plan and the static split in one
# process), every H2D copy and kernel as CSV under $OUT (analysed by bench/dev/copy_gaps.py).
#   bench/dev/copy_gaps.sh BUDGET BATCH    e.g. 2GiB 4096
set -euo pipefail
budget=${1:-2GiB} batch=${2:-4096}
out=${OUT:-/tmp}/gaps-$budget-$batch
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1 || true)
[ -n "$NSYS" ] || { echo "copy_gaps: no nsys on this machine"; exit 0; }
rm -f /tmp/gaps.nsys-rep /tmp/gaps.sqlite
"$NSYS" profile --trace=cuda --sample=none --cpuctxsw=none -o /tmp/gaps -f true \
  ./build/spillway bench stream --layers 32 --layer-mib 128 --batch "$batch" --budget "$budget" --policy plan >/dev/null
"$NSYS" stats --report cuda_gpu_trace --format csv -o "$out" /tmp/gaps.nsys-rep >/dev/null
gzip -f "$out"*.csv
ls -la "$out"*
