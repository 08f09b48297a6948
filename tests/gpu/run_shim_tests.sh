#!/usr/bin/env bash
# GPU acceptance of `spillway run` / libspillway-preload.so (issue 6). Run by `make test-gpu`
# (ctest test shim_gpu) or by hand:
#   tests/gpu/run_shim_tests.sh build/spillway [WORKDIR]
# Every check runs under `spillway run --budget 4GiB --`. Prints PASS/FAIL/SKIP per check, a
# summary, and a markdown table for bench/RESULTS.md (also in WORKDIR/results.md). Exit 0 when
# nothing failed, 1 otherwise, 77 (skipped) without a GPU. Takes about 2-3 minutes.
set -u
CLI=${1:?usage: run_shim_tests.sh PATH/TO/spillway [WORKDIR]}
CLI=$(readlink -f "$CLI")
WORK=${2:-$(mktemp -d /tmp/spillway-shim.XXXXXX)}
HERE=$(cd "$(dirname "$0")" && pwd)
BUDGET=4GiB
BUDGET_B=$((4 << 30))
PY=${PYTHON:-python3}
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "shim_gpu: skipped: no GPU (nvidia-smi -L failed)"
  exit 77
fi
mkdir -p "$WORK"
cd "$WORK" || exit 1

pass=0; fail=0; skip=0
declare -a rows
result() { # result PASS|FAIL|SKIP name detail
  echo "$1: $2${3:+ -- $3}"
  rows+=("| $2 | $1 | ${3//|/\\|} |")
  case $1 in PASS) pass=$((pass+1));; FAIL) fail=$((fail+1));; *) skip=$((skip+1));; esac
}
capped() { timeout 120 "$CLI" run --budget "$BUDGET" -- "$@"; }

echo "== spillway shim acceptance on: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
echo "== work dir: $WORK"

# ---- build the C/CUDA programs ----
built=1
if [ -x "$NVCC" ]; then
  "$NVCC" -O2 -o chunks_static "$HERE/chunks.cu" >build.log 2>&1 || built=0
  "$NVCC" -O2 -cudart shared -o chunks_shared "$HERE/chunks.cu" >>build.log 2>&1 || built=0
  "$NVCC" -O2 -o driver_alloc "$HERE/driver_alloc.c" -lcuda -ldl >>build.log 2>&1 || built=0
else
  built=0; echo "nvcc not found (set NVCC)" >build.log
fi
[ $built = 1 ] || { result FAIL "build test programs with nvcc" "$(tail -3 build.log | tr '\n' ' ')"; }

check_chunks() { # name binary mode
  local out; out=$(capped "./$2" "$3" 4 2>&1); local rc=$?
  local last; last=$(echo "$out" | grep '^chunk ' | head -1)
  if [ $rc = 0 ] && echo "$out" | grep -q "out of memory: requested 1073741824 B, charged 4294967296 B of budget 4294967296 B"; then
    result PASS "$1" "4 x 1 GiB, then $last; shim line on stderr"
  else
    result FAIL "$1" "rc=$rc: $(echo "$out" | tail -4 | tr '\n' ' ')"
  fi
}

if [ $built = 1 ]; then
  check_chunks "cudaMallocManaged 1 GiB chunks, static cudart" chunks_static managed
  check_chunks "cudaMallocManaged 1 GiB chunks, shared cudart" chunks_shared managed
  check_chunks "cudaMalloc 1 GiB chunks, static cudart" chunks_static malloc
  check_chunks "cudaMalloc 1 GiB chunks, shared cudart" chunks_shared malloc
  check_chunks "cudaMallocAsync 1 GiB chunks, static cudart" chunks_static async
  for mode in link dlsym; do
    out=$(capped ./driver_alloc $mode 4 2>&1); rc=$?
    name="cuMemAlloc 1 GiB chunks, driver API ($mode)"
    [ $mode = dlsym ] && name="dlopen(libcuda.so.1) + dlsym(cuMemAlloc_v2) 1 GiB chunks"
    if [ $rc = 0 ]; then result PASS "$name" "$(echo "$out" | grep chunks)"; else result FAIL "$name" "rc=$rc: $(echo "$out" | tail -3 | tr '\n' ' ')"; fi
  done
  out=$(capped ./chunks_static nvml 2>&1); rc=$?
  if [ $rc = 0 ]; then result PASS "NVML nvmlDeviceGetMemoryInfo agrees with cudaMemGetInfo" "$(echo "$out" | grep -E 'Info' | tr '\n' ' ')"
  else result FAIL "NVML nvmlDeviceGetMemoryInfo agrees with cudaMemGetInfo" "rc=$rc: $(echo "$out" | tail -3 | tr '\n' ' ')"; fi
  # nvidia-smi itself under the shim (informational: it reads NVML the same way)
  smi=$(capped nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader 2>&1 | head -1)
  echo "   nvidia-smi under the shim: $smi"

  # overhead of an intercepted cudaMalloc + cudaFree pair, same binary, same run
  base=$(./chunks_static bench 500 2>&1 | awk '/median_us/{print $2}')
  shim=$(capped ./chunks_static bench 500 2>&1 | awk '/median_us/{print $2}')
  if [ -n "$base" ] && [ -n "$shim" ]; then
    result PASS "cudaMalloc(1 MiB)+cudaFree median, without / with shim" "$base us / $shim us"
  else
    result FAIL "cudaMalloc+cudaFree micro-benchmark" "base='$base' shim='$shim'"
  fi
fi

# ---- Python frameworks ----
py() { # name expected-substring cmd...
  local name=$1; shift
  local out; out=$("$@" 2>&1); local rc=$?
  local line; line=$(echo "$out" | grep -E '^(SKIP|torch|no error|wrong|jax|cupy|loss)' | tail -1)
  if [ $rc = 77 ]; then result SKIP "$name" "$line"
  elif [ $rc = 0 ]; then result PASS "$name" "$line"
  else result FAIL "$name" "rc=$rc: ${line:-$(echo "$out" | tail -3 | tr '\n' ' ')}"; fi
}
FW="$HERE/frameworks.py"
ref=$(timeout 120 env CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PY" "$FW" torch-train 2>&1); ref_rc=$?
for conf in "" "expandable_segments:True" "backend:cudaMallocAsync"; do
  label=${conf:-default allocator}
  export PYTORCH_CUDA_ALLOC_CONF=$conf
  py "PyTorch ($label): mem_get_info total == 4 GiB" capped "$PY" "$FW" torch-info $BUDGET_B
  py "PyTorch ($label): 5 GiB tensor raises torch.OutOfMemoryError" capped "$PY" "$FW" torch-oom
  out=$(capped env CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PY" "$FW" torch-train 2>&1); rc=$?
  if [ $ref_rc = 77 ] || [ $rc = 77 ]; then result SKIP "PyTorch ($label): training step as without the shim" "torch not importable"
  elif [ $rc = 0 ] && [ $ref_rc = 0 ] && [ "$(echo "$out" | grep ^loss)" = "$(echo "$ref" | grep ^loss)" ]; then
    result PASS "PyTorch ($label): training step as without the shim" "$(echo "$out" | grep ^loss)"
  else result FAIL "PyTorch ($label): training step as without the shim" "with: $(echo "$out" | tail -1) / without: $(echo "$ref" | tail -1)"; fi
  unset PYTORCH_CUDA_ALLOC_CONF
done
py "JAX default preallocation starts within the budget" capped "$PY" "$FW" jax $BUDGET_B
py "CuPy past the budget raises cupy.cuda.memory.OutOfMemoryError" capped "$PY" "$FW" cupy-oom

# ---- summary ----
{
  echo "| check (spillway run --budget $BUDGET, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)) | result | detail |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${rows[@]}"
} >results.md
echo
cat results.md
echo
echo "shim_gpu: $pass passed, $fail failed, $skip skipped (results in $WORK/results.md)"
[ $fail = 0 ] && echo "shim_gpu: PASS" || echo "shim_gpu: FAIL"
[ $fail = 0 ]
