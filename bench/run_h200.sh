#!/usr/bin/env bash
# Everything the GPU machine must prove, in one batch: build, the suite against the cuda backend,
# and the benchmarks whose numbers go into bench/RESULTS.md. Usage:
#   bench/run_h200.sh [build] [test] [replay] [alloc] [probe] [stream] [shim] [managed] [plan]
#                     [pytest] [peers] [cost] [offload] [diffusion] [pipeline] [smallcard]
#                     [train] [pytest-alloc] [torchalloc] [ddp] [diffab] [grain] [ring] [shapes] [pageable] [quant]
#                     [moe] (default: all but diffusion, pipeline, smallcard, train, diffab, grain, ring, shapes,
#                     pageable, quant, moe)
# Logs go to $OUT (or ./h200-out) so they come back from the device machine. PYEXTRA: more of
# PYTHONPATH for a benchmark (pyrun).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/h200-out}
OUT=/tmp/h200-logs      # many files here; one archive of them goes to $FINAL at the end
mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/logs.tgz" -C "$OUT" . 2>/dev/null' EXIT
TRACES=${TRACES:-tests/data}
steps=${*:-build test shim replay alloc probe stream managed plan pytest peers offload pytest-alloc torchalloc ddp}
has() { [[ " $steps " == *" $1 "* ]]; }
# py SECONDS ARGS...: python3 ARGS against this build, under a timeout
py() {
  local secs=$1; shift
  SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python${PYEXTRA:+:$PYEXTRA} timeout "$secs" python3 "$@"
}
# pyrun NAME SECONDS SCRIPT ARGS...: a Python benchmark against this build, with --json
# $OUT/NAME.json, stdout to the console and $OUT/NAME.txt, stderr to $OUT/NAME.err (its tail shown)
pyrun() {
  local name=$1 secs=$2; shift 2
  py "$secs" "$@" --json "$OUT/$name.json" 2>"$OUT/$name.err" | tee "$OUT/$name.txt" || rc=1
  tail -15 "$OUT/$name.err"
}
log() { echo "=== $* ($(date +%T))"; }
rc=0

if has build; then
  log build
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$OUT/gpu.txt"
  make deps >/dev/null
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build build -j 16 >"$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
fi
if has test; then
  log make test-gpu
  # the python label runs on emu with /usr/bin/python3 (no pytest there): see the pytest section
  (cd build && SPW_TEST_BACKEND=cuda timeout 420 ctest --output-on-failure -j 1 -E "^shim" -LE python ) >"$OUT/test-gpu.log" 2>&1 || rc=1
  tail -25 "$OUT/test-gpu.log"
fi
if has shim; then
  log shim
  timeout 400 tests/gpu/run_shim_tests.sh build/spillway /tmp/shim-work >"$OUT/shim.log" 2>&1 || rc=1
  cp /tmp/shim-work/results.md "$OUT/shim-results.md" 2>/dev/null
  tail -60 "$OUT/shim.log"
fi
if has replay; then
  log replay
  for t in gpt2_train bert_varlen_train; do
    for b in cuda emu; do
      ./build/spillway replay "$TRACES/$t.trace.gz" --backend $b --json >"$OUT/replay-$t-$b.json" || rc=1
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], {k: d[k] for k in ('peak_reserved_bytes','peak_live_bytes','trace_peak_live','reserved_over_live','backend_allocs','backend_frees','ops','ns_per_op')})" "$OUT/replay-$t-$b.json" $t $b
    done
  done
fi
if has alloc; then
  log bench alloc
  ./build/spillway bench alloc --backend cuda | tee "$OUT/bench-alloc.txt" || rc=1
  ./build/spillway bench alloc --backend cuda --json >"$OUT/bench-alloc.json" || rc=1
fi
if has probe; then
  log probe
  /usr/bin/time -f "probe wall %e s" ./build/spillway probe 2>&1 | tee "$OUT/probe.txt" || rc=1
  /usr/bin/time -f "probe --quick wall %e s" ./build/spillway probe --quick --json >"$OUT/probe-quick.json" 2>"$OUT/probe-quick.err" || rc=1
  cat "$OUT/probe-quick.err"
fi
if has stream; then
  log bench stream
  common="--layers 32 --layer-mib 128 --budget 2GiB"
  for args in "--batch 16 --residency explicit --policy lru" "--batch 16 --residency managed --policy lru" \
              "--batch 16 --policy lru,plan" "--batch 4096 --policy lru,plan"; do
    echo "--- spillway bench stream $common $args"
    ./build/spillway bench stream $common $args 2>&1 | tee -a "$OUT/bench-stream.txt" || rc=1
    ./build/spillway bench stream $common $args --json >>"$OUT/bench-stream.jsonl" 2>>"$OUT/bench-stream.err" || rc=1
  done
  for early in 1 2 4; do
    echo "--- SPILLWAY_CONF=prefetch_early=$early spillway bench stream $common --batch 4096 --policy plan"
    SPILLWAY_CONF=prefetch_early=$early ./build/spillway bench stream $common --batch 4096 --policy plan 2>&1 | grep -E "^plan|moved" | tee -a "$OUT/bench-stream.txt"
  done
fi
if has managed; then
  # managed residency: the raw CUDA pipeline (bench/dev/managed_pipe.cu, variants 0 = pinned
  # copies, 1 = what the library does) and the library bench, alternating, on one machine
  log managed
  nvcc -O2 -std=c++17 -o /tmp/managed_pipe bench/dev/managed_pipe.cu -lpthread || rc=1
  for r in 1 2 3; do
    timeout 120 /tmp/managed_pipe 0,1 2>&1 | grep -E "^ *[01] " | tee -a "$OUT/managed.txt"
    ./build/spillway bench stream --layers 32 --layer-mib 128 --batch 16 --budget 2GiB --residency managed \
      --policy lru 2>&1 | grep -E "^lru" | sed 's/^/library /' | tee -a "$OUT/managed.txt" || rc=1
  done
fi
if has plan; then
  # policy=plan against the hand-tuned static split (the peer inside bench stream), every budget
  # and batch of the acceptance, one process each; one summary line per case
  log "bench stream: plan against the static split"
  for budget in 1GiB 2GiB 3GiB; do
    for batch in 16 4096; do
      j="$OUT/plan-$budget-$batch.json"
      ./build/spillway bench stream --layers 32 --layer-mib 128 --batch $batch --budget $budget \
        --policy lru,plan --json >"$j" 2>>"$OUT/plan.err" || rc=1
      python3 - "$j" $budget $batch <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1])); r = {x["policy"]: x for x in d["runs"]}
lru, plan, split = r["lru"], r["plan"], r.get("split", {})
print(f"budget {sys.argv[2]:>4} batch {sys.argv[3]:>4}: lru {lru['pass_ms']:.2f} ms ({lru['ratio_to_link_bound']:.3f} of link)"
      f" | plan {plan['pass_ms']:.2f} ms {plan['bytes_per_pass']/2**20:.0f} MiB bitwise {plan['bitwise_equal']}"
      f" | split {split.get('pass_ms', 0):.2f} ms {split.get('bytes_per_pass', 0)/2**20:.0f} MiB k={split.get('resident_layers')} {split.get('placement')}"
      f" | plan/split {d.get('plan_over_static_split', float('nan')):.3f}"
      f" | plan per pass {[round(x, 2) for x in plan['per_pass_ms']]}"
      f" | split per pass {[round(x, 2) for x in split.get('per_pass_ms', [])]}")
print("   ", plan.get("policy_state"))
PY
    done
  done
fi
if has pytest; then
  log "pytest tests/gpu/test_torch_offload_gpu.py test_torch_train_gpu.py test_peft_gpu.py test_quantized_gpu.py test_compile_gpu.py"
  py 400 -m pytest -q -s -p no:logging tests/gpu/test_torch_offload_gpu.py tests/gpu/test_torch_train_gpu.py \
    tests/gpu/test_peft_gpu.py tests/gpu/test_quantized_gpu.py tests/gpu/test_compile_gpu.py >"$OUT/pytest-gpu.log" 2>&1 || rc=1
  grep -E "worst|passed|failed|Error" "$OUT/pytest-gpu.log" | tail -30
fi
if has peers; then
  log "bench/peers/torch_stream.py"
  pyrun torch_stream 300 bench/peers/torch_stream.py --budget 1GiB,2GiB,3GiB --batch 16,4096
fi
if has cost; then
  log "bench/dev/acquire_cost.py"
  py 120 bench/dev/acquire_cost.py 2>&1 | tee "$OUT/acquire_cost.txt" || rc=1
fi
if has offload; then
  log "bench/peers/torch_offload.py"
  pyrun torch_offload 540 bench/peers/torch_offload.py ${OFFLOAD_ARGS:-}
fi
# diffusers is not on the GPU machine's image: its src/ is carried in .peers/diffusers/src (never committed)
DIFFUSERS_PATH=${DIFFUSERS:-$PWD/.peers/diffusers}/src
if has diffusion; then
  log "bench/peers/torch_diffusion.py"
  PYEXTRA=$DIFFUSERS_PATH pyrun torch_diffusion 580 bench/peers/torch_diffusion.py ${DIFFUSION_ARGS:-}
fi
if has diffab; then
  # the denoisers of the "offload any model" acceptance, each variant against resident in one
  # process (bench/dev/diffusion_ab.py): SD 1.5 at 40%, SDXL at 35%, Flux at 8 GiB, each in the
  # arena's two modes, the UNets also with their lists' runs grouped as before the partition told
  # lists not called back to back apart (runs=grouped); then workloads a and b in plain segments
  # (the default's figures are the offload section's)
  log "bench/dev/diffusion_ab.py"
  for c in "sd15 0.40 3 plan;plan:runs=grouped;plan:vmm=off" "sdxl 0.35 2 plan;plan:runs=grouped;plan:vmm=off" \
           "flux 8589934592 2 plan;plan:vmm=off"; do
    set -- $c
    PYEXTRA=$DIFFUSERS_PATH py 300 bench/dev/diffusion_ab.py --model $1 --budget $2 --rounds $3 --variants "$4" \
      >"$OUT/diffab-$1.txt" 2>&1 || rc=1
    grep -v "^round\|Warn\|float32" "$OUT/diffab-$1.txt" | tail -8
  done
  for wl in a b; do
    SPILLWAY_CONF=vmm=off pyrun offload-$wl-segments 300 bench/peers/torch_offload.py --workload $wl \
      --variants resident,spillway-plan
  done
fi
if has grain; then
  # the partition's grain on the UNets (docs/design.md, "The physical limit"): units of at most a
  # sixteenth and a thirty-second of the budget (unit_max, bytes of today's SD 1.5 and SDXL at
  # 40% and 35%) against the default quarter, in pages and in plain segments, each against
  # resident in one process; then the recorded timelines at those grains for
  # bench/dev/schedule_sim.py (run it on any machine over $OUT/room-grain.json)
  log "the partition's grain: bench/dev/diffusion_ab.py, bench/dev/room_bound.py"
  for c in "sd15 0.40 42991616 21495808" "sdxl 0.35 112197632 56098816"; do
    set -- $c
    PYEXTRA=$DIFFUSERS_PATH py 400 bench/dev/diffusion_ab.py --model $1 --budget $2 --rounds 3 \
      --variants "plan;plan:unit_max=$3;plan:unit_max=$4;plan:vmm=off;plan:vmm=off,unit_max=$4" \
      >"$OUT/grain-$1.txt" 2>&1 || rc=1
    grep -v "^round\|Warn\|float32\|first 20" "$OUT/grain-$1.txt" | tail -9
  done
  PYEXTRA=$DIFFUSERS_PATH py 300 bench/dev/room_bound.py --json "$OUT/room-grain.json" \
    --cases sd15:0.40,sd15:0.40:16,sd15:0.40:32,sdxl:0.35,sdxl:0.35:16,sdxl:0.35:32 2>&1 | grep "units" || rc=1
  cp "$OUT/room-grain.json" "$FINAL/" 2>/dev/null
fi
if has ring; then
  # the static split through a ring (option ring, off by default until measured here): SD 1.5 at
  # 40% and SDXL at 35%, each variant against resident in one process (the plan's own choice
  # with and without the ring, and the split named); the same at finer units, step by step
  # (bench/dev/plan_steps.py, div=N: units of at most budget / N); then the GPU offload tests
  # with the ring on
  log "the ring: bench/dev/diffusion_ab.py, bench/dev/plan_steps.py"
  for c in "sd15 0.40" "sdxl 0.35"; do
    set -- $c
    PYEXTRA=$DIFFUSERS_PATH py 400 bench/dev/diffusion_ab.py --model $1 --budget $2 --rounds 2 \
      --variants "plan;plan:ring=on;plan:ring=on,pipeline=split;plan:pipeline=split" \
      >"$OUT/ring-ab-$1.txt" 2>&1 || rc=1
    grep -v "^round\|Warn\|float32" "$OUT/ring-ab-$1.txt" | tail -10
  done
  PYEXTRA=$DIFFUSERS_PATH py 500 bench/dev/plan_steps.py --cases sd15:0.40,sdxl:0.35 --steps 30 --quiet \
    --options "ring=on;ring=on,div=16;ring=on,div=32;div=16" >"$OUT/ring-steps.txt" 2>&1 || rc=1
  grep -v "Warn\|float32" "$OUT/ring-steps.txt" | tail -40
  SPILLWAY_CONF=ring=on py 300 -m pytest -q tests/gpu/test_torch_offload_gpu.py >"$OUT/ring-pytest.log" 2>&1 || rc=1
  tail -3 "$OUT/ring-pytest.log"
fi
if has shapes; then
  # diffusers models whose forward reaches the weights by other roads (bench/dev/diffusers_shapes.py):
  # weight_norm's pre-hooks, fp8 layerwise casting, GGUF parameters; each bitwise against resident
  log "bench/dev/diffusers_shapes.py"
  PYEXTRA=$DIFFUSERS_PATH py 400 \
    bench/dev/diffusers_shapes.py ${SHAPES_ARGS:-} 2>"$OUT/shapes.err" | tee "$OUT/shapes.txt" || rc=1
  tail -15 "$OUT/shapes.err"
fi
if has pageable; then
  # the path a system that refuses to pin (WSL2) gives: workload b with its host copies pageable
  # (host_register=off); the offload section's b is the pinned figure
  log "workload b, host copies pageable"
  SPILLWAY_CONF=host_register=off pyrun offload-b-pageable 300 bench/peers/torch_offload.py --workload b \
    --variants resident,spillway-plan
  # page-locked memory short (4 GiB of the 13.5 GiB, as WSL2 may allow): given to the streamed
  # units by the looks at step ends, against left where the registrations put it
  for rb in on off; do
    log "workload b, pin_limit=4GiB, pin_rebalance=$rb"
    SPILLWAY_CONF=pin_limit=4GiB,pin_rebalance=$rb pyrun offload-b-pin4-$rb 300 bench/peers/torch_offload.py \
      --workload b --variants spillway-plan
  done
fi
if has pipeline; then
  log "bench/peers/torch_pipeline.py"
  PYEXTRA=$DIFFUSERS_PATH pyrun torch_pipeline 580 bench/peers/torch_pipeline.py ${PIPELINE_ARGS:-}
fi
if has smallcard; then
  log "bench/peers/torch_smallcard.py"
  pyrun torch_smallcard 580 bench/peers/torch_smallcard.py ${SMALLCARD_ARGS:-}
fi
if has train; then
  log "bench/peers/torch_train.py"
  pyrun torch_train ${TRAIN_SECS:-580} bench/peers/torch_train.py ${TRAIN_ARGS:-}
fi
if has pytest-alloc; then
  # spillway.torch.use_allocator against the default allocator, both modes: four processes at
  # once (tests/gpu/torch_alloc_cases.py), about 60-120 s
  log "pytest tests/gpu/test_torch_alloc_gpu.py"
  py 200 -m pytest -q -s tests/gpu/test_torch_alloc_gpu.py >"$OUT/pytest-torch-alloc.log" 2>&1 || rc=1
  grep -E "^(default|global|pool|kv):|^  [a-z_]+ (default|global|pool|kv):|passed|failed|Error" \
    "$OUT/pytest-torch-alloc.log" | cut -c1-600
fi
if has torchalloc; then
  # the acceptance workloads (bench/peers/torch_alloc.py, about 300-370 s; TORCH_ALLOC_ARGS
  # narrows them, e.g. "--workloads gpt2 --steps 20")
  log "bench/peers/torch_alloc.py"
  pyrun torch_alloc ${TORCH_ALLOC_SECS:-420} bench/peers/torch_alloc.py ${TORCH_ALLOC_ARGS:-}
fi
if has ddp; then
  # two GPUs: DDP with use_allocator per rank and a budget per device; then the interposer with
  # per-device budgets on the real devices
  log "torchrun DDP with use_allocator, budgets ${SPW_DDP_BUDGETS:-0:6GiB;1:3GiB}"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python timeout 240 \
      torchrun --nproc_per_node 2 tests/gpu/ddp_alloc.py >"$OUT/ddp.log" 2>&1 || rc=1
    grep RESULT "$OUT/ddp.log" || tail -30 "$OUT/ddp.log"
    log "spillway run --budget '0:3GiB;1:5GiB' on two GPUs"
    timeout 120 ./build/spillway run --budget "0:3GiB;1:5GiB" -- python3 tests/gpu/run_devices.py >"$OUT/run-devices.log" 2>&1 || rc=1
    grep RESULT "$OUT/run-devices.log" || tail -30 "$OUT/run-devices.log"
  else
    echo "ddp: fewer than two GPUs on this machine: not run"
  fi
fi
if has quant; then
  # quantized models offloaded: transformers' classes under torchao and bitsandbytes (each where installed)
  for q in torchao-int8 bnb-nf4; do
    log "transformers_zoo.py --quant $q"
    py 300 bench/dev/transformers_zoo.py --quant $q ${QUANT_ZOO:-llama qwen3 gemma2 mixtral qwen3_moe t5} \
      >"$OUT/zoo-$q.txt" 2>&1 || rc=1
    tail -12 "$OUT/zoo-$q.txt"
  done
fi
if has moe; then
  # greedy decoding through a mixture of experts in a ModuleList (bench/dev/moe_decode.py)
  log "bench/dev/moe_decode.py"
  py 150 bench/dev/moe_decode.py ${MOE_ARGS:-} >"$OUT/moe.txt" 2>&1 || rc=1
  tail -8 "$OUT/moe.txt"
  # transformers' fused experts, expert by expert against whole (bench/dev/hf_moe_decode.py)
  log "bench/dev/hf_moe_decode.py"
  for args in "--arch qwen3_moe --layers 12 --budget 4GiB --batch 1" "--arch qwen3_moe --layers 12 --budget 4GiB --batch 4" \
              "--arch mixtral --layers 4 --budget 6GiB --batch 1" "--arch mixtral --layers 4 --budget 6GiB --batch 4"; do
    echo "--- hf_moe_decode.py $args"
    py 150 bench/dev/hf_moe_decode.py $args 2>>"$OUT/hf_moe.err" | tee -a "$OUT/hf_moe.txt" || rc=1
  done
fi
log "done rc=$rc"
exit $rc
