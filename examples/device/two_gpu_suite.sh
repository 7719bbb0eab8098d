#!/usr/bin/env bash
# Every multi-GPU test, example and probe on one 2-GPU machine (nvidia-h200-x2 or nvidia-h100-x2), in three calls
# of < 9.8 min each (a machine kept warm between them reuses A's build):
#   run(command="FO_PART=A bash examples/device/two_gpu_suite.sh", carry=["build/cutlass", ".whl"], kind="nvidia-h200-x2")
#   run(command="FO_PART=B bash examples/device/two_gpu_suite.sh", carry=["build/cutlass", ".whl"])
#   run(command="FO_PART=C bash examples/device/two_gpu_suite.sh", carry=["build/cutlass", ".whl"])
# A: build the library; every GPU test file (tests/test_gpu_*.py: ops, peer, ring, kernels, gather, gather_nccl; the
#    2-GPU tests run on the 2 GPUs); the fault probes (peer 2 ranks, ring 3 ranks, NCCL 1 rank, NCCL
#    routes on the 2 GPUs: --nccl-world 2); the CPU side (cpu_side
#    below) in the background meanwhile.
# B: the CPU side in the background; a rerun of the GPU test files in FO_RERUN; the op benchmarks on 2 GPUs
#    (examples/bench_gather.py and examples/bench_ops.py --fuse auto, a few shapes each: a check that they run, not
#    the grid); examples/bench_moe.py (the MoE ops, step "moe"); the call timeline (python -m flashoverlap_inductor.bench
#    timeline: one shape, both GEMM starts, a PNG
#    each).
# C: alone on the machine, a short e2e run (llama3-8b, 8 layers, sp plan, batch 1, seq 4096: train and prefill;
#    Inductor, Inductor + async-TP, flashoverlap, the bound; prefill also under CUDA graphs: inductor-ro,
#    flashoverlap-ro, which take the fused ops' host time away where a step is host-bound).
# $OUT (8 files at most): A: build.log gpu_tests.log faults.log cpu_tests.log coverage.log gpus.txt install.log;
#   B: gpu_tests.log cpu_tests.log coverage.log bench_ops.log bench_gather.log e2e.log e2e.json (+ the benchmarks'
#   JSON, which do not all come back).
# FO_WORLD: GPUs of bench_ops / bench_gather / bench_moe / e2e (default 2; 4 on an nvidia-h200-x4 or h100-x4).
# FO_E2E_PRESET, FO_E2E_LAYERS: the e2e model (default llama3-8b, 8 layers; e.g. qwen3-moe 4 with FO_E2E_PLAN=ep).
#   The MoE rows (issue 32): FO_PART=C FO_E2E_PRESET=qwen3-moe FO_E2E_LAYERS=4 FO_E2E_PLAN=ep
#   FO_E2E_ARGS="--fuse always --value-calls 4" (the ep model's result varies from call to call on torch 2.11:
#   docs/design.md; bound does not run on ep) FO_E2E_BACKENDS=inductor,flashoverlap@moe_p2p_cuda+moe_settle_deferred,
#   flashoverlap@moe_p2p_cuda+moe_settle_deferred+moe_peer; append +shadow_check to a backend to compare every fused
#   call with its unfused reference
# FO_FAULT_SPECS: the fault probes' argument lists, ';'-separated; FO_TIMELINE_ARGS: more timeline arguments (e.g.
#   "--op reduce_scatter" or "--op all_reduce": the peer route's call timeline instead of the all_gather one, 1 PNG;
#   "--op reduce_scatter_pull --lead 2" with FO_TIMELINE_SHAPES=4096x4096x8192: the pull route's, handshake and push).
# The MoE check alone (tests/test_gpu_moe.py, tests/test_moe_plan_kernel.py, bench_moe, moe_profile):
#   FO_PART=B FO_SKIP="cpu coverage ops gather scatter push timeline".
# FO_MOEPROF_SHAPES, FO_MOEPROF_PLANS: moe_profile's shapes and bench_moe plans (e.g. blocks+deferred+plan_triton;
#   blocks+deferred+no_rows and blocks+deferred+peer+no_rows: the dispatch as an inference graph runs it).
# The MoE stacks against eager (correctness, 49th session): torchrun --nproc_per_node=2
#   examples/device/moe_stack_check.py --layers 2 --tokens 2048 --sp 4096 [--lag-ms 3] --variants ...
# FO_OPS_CAP_S: bench_ops' cap (default 120 s; FO_OPS_SHAPES=grid, the 16-shape grid, needs ~300); FO_OPS_ARGS: more
#   bench_ops arguments (e.g. "--ops all_to_all").
# FO_GATHER_ARGS: more bench_gather arguments (e.g. "--warmup-shapes 3"); FO_E2E_TRACE=1: the e2e run writes a profiler
#   trace per case, backend and rank (every rank's brought back as $OUT/e2e_traces.tgz, ~0.4 MB per trace) and
#   trace_gaps.log (where each traced step's GPU idles, and which rank its collectives waited for: bench.trace_summary).
# push (B): examples/device/push_probe.py, the gather schedule of copy-engine pushes and stream memory operations
#   (FO_PUSH_ARGS: e.g. "--shapes 16384x6144x4096").
# FO_RERUN_CAP_S (B): the GPU test rerun's cap (default 120 s; tests/test_gpu_gather.py under both starts wants ~200).
# scatter (B): examples/device/scatter_pull_bench.py, the pull route (its two schedules, the setting
#   scatter_start: handshake and push) against the peer route and sequential (FO_SCATTER_SHAPES: M x N x K with K the
#   whole reduction; FO_SCATTER_SUM_SHAPES; FO_SCATTER_CAP_S, default 150); $OUT/scatter.log.
# FO_SKIP: any of "build tests faults cpu coverage ops gather scatter moe moeprof push timeline e2e"; FO_BUDGET_S: the
#   part's budget (default 570).
# FO_BUILD_CACHE=1: after the build, $OUT/build_obj.tgz holds build/obj (the objects and their .cmd stamps: the nvcc
#   command and a digest of each unit's sources, ~5 MB). Unpacked here (`mkdir -p build && tar xzf
#   /work/.device/N/build_obj.tgz -C build`) and carried (`carry=[..., "build/obj"]`), it lets a fresh machine's build
#   recompile only the units whose sources changed (the GEMM units, ~65 of the build's ~90 s, rarely do) and link.
set -uo pipefail
START=$SECONDS
PART=${FO_PART:-A}
WORLD=${FO_WORLD:-2}  # ranks (one per GPU) of the benchmarks and the e2e run; the timeline's: FO_TIMELINE_WORLD (2;
# its all_gather timeline takes any count, the peer route's --op reduce_scatter / all_reduce 2 only)
SKIP=" ${FO_SKIP:-} "
OUT=${OUT:-/tmp/fo_out}; mkdir -p "$OUT" /tmp/fo_probe
if [ "$PART" = A ] && [[ "$SKIP" != *" build "* ]] || [ ! -f build/libflashoverlap_sm90.so ]; then
  timeout 300 python3 -m flashoverlap_inductor.build --keep-going -j "$(nproc)" >"$OUT/build.log" 2>&1
  echo "build rc=$? in $((SECONDS - START)) s: $(grep -c '^FAILED' "$OUT/build.log") failed" | tee -a "$OUT/build.log"
  grep -m5 -B2 -A5 ' error' "$OUT/build.log" | head -40
  if [ -n "${FO_BUILD_CACHE:-}" ] && [ -d build/obj ]; then
    tar czf "$OUT/build_obj.tgz" -C build obj && echo "build cache: $(du -h "$OUT/build_obj.tgz" | cut -f1)"
  fi
fi
source examples/device/setup_env.sh
END=$((START + ${FO_BUDGET_S:-570}))
left() { echo $((END - SECONDS - 5)); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 1 ? l : 1) : $1 )); }
export OMP_NUM_THREADS=4 FO_PG_TIMEOUT_S=120
TORCHRUN=(python3 -m torch.distributed.run --standalone)
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >>"$OUT/gpus.txt" 2>&1
step() { echo "=== $1 ($(( SECONDS - START )) s)"; }
# The GPUs' SM clock and power while a timed step runs (nvidia-smi every 200 ms; long GEMMs back to back can hit the
# power limit, which moves rankings: docs/results.md): medians over the busy samples (utilization >= 50%: not the
# start-up, the compiles, the teardown), per GPU, appended to the step's log and printed.
clocks_on() { nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw --format=csv,noheader,nounits \
  -lms 200 >/tmp/fo_probe/clocks.csv 2>/dev/null & CLOCKS_PID=$!; }
clocks_off() {  # $1: the step's log
  kill "$CLOCKS_PID" 2>/dev/null; wait "$CLOCKS_PID" 2>/dev/null; CLOCKS_PID=
  python3 - /tmp/fo_probe/clocks.csv 2>&1 <<'PY' | tee -a "$1"
import statistics, sys
def num(x):
    try:
        return float(x)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None
by = {}
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) == 4 and f[0].isdigit():
        by.setdefault(int(f[0]), []).append([num(x) for x in f[1:]])
for gpu, rows in sorted(by.items()):
    busy = [r for r in rows if r[0] is not None and r[0] >= 50]
    mhz, watts = (sorted(r[i] for r in busy if r[i] is not None) for i in (1, 2))
    text = f"clocks: GPU {gpu}, {len(busy)} of {len(rows)} samples busy"
    if mhz:
        text += f": SM MHz median {statistics.median(mhz):.0f} (min {mhz[0]:.0f})"
    if watts:
        text += f", W median {statistics.median(watts):.0f} (max {watts[-1]:.0f})"
    print(text)
if not by:
    print("clocks: no samples (nvidia-smi missing or failing)")
PY
}
trap '[ -n "${CLOCKS_PID:-}" ] && kill "$CLOCKS_PID" 2>/dev/null' EXIT
# The CPU side (gloo ranks, no GPU): the pass tests and the coverage of the tiny presets under every plan at batch
# 1, 2 and 4, under this machine's torch (2.11: its post-grad graphs differ from 2.13's). Logs: cpu_tests.log,
# coverage.log.
cpu_side() {
  if [[ "$SKIP" != *" cpu "* ]]; then
    step "CPU pass tests under torch $(python3 -c 'import torch; print(torch.__version__)')" >"$OUT/cpu_tests.log"
    (cd "$REPO" && CUDA_VISIBLE_DEVICES= timeout 400 python3 -m pytest -q -p no:cacheprovider \
      tests/test_pass_gather.py tests/test_coverage_cli.py tests/test_combine_pass.py tests/test_combine_op.py >>"$OUT/cpu_tests.log" 2>&1)
    echo "cpu pytest rc=$?" >>"$OUT/cpu_tests.log"
  fi
  if [[ "$SKIP" != *" coverage "* ]]; then
    for spec in "tiny-llama sp" "tiny-qwen3 sp" "tiny-gemma3 sp" "tiny-llama tp" "tiny-moe ep" "tiny-mixtral ep" \
        "tiny-gemma3 tp" "tiny-llama tp tp_sequence=off"; do  # a third word: --experiments (or name=value)
      set -- $spec
      step "coverage $spec" >>"$OUT/coverage.log"
      CUDA_VISIBLE_DEVICES= timeout 200 "${TORCHRUN[@]}" --nproc_per_node=2 -m flashoverlap_inductor.bench \
        coverage --device cpu --preset "$1" --plan "$2" --batch 1,2,4 --seq 16 ${3:+--experiments "$3"} \
        >>"$OUT/coverage.log" 2>&1
      echo "coverage $spec rc=$?" >>"$OUT/coverage.log"
    done
  fi
}
if [ "$PART" = A ]; then
  cpu_side &  # the CPU side on the host's other cores while the GPU steps run
  CPU_PID=$!
  if [[ "$SKIP" != *" tests "* ]]; then
    step "GPU tests"
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 timeout "$(cap 300)" python3 -m pytest -q -rs -p no:cacheprovider \
      --durations=8 "$REPO"/tests/test_gpu_*.py >"$OUT/gpu_tests.log" 2>&1
    echo "gpu pytest rc=$?" | tee -a "$OUT/gpu_tests.log"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
  fi
  if [[ "$SKIP" != *" faults "* ]]; then
    IFS=';' read -ra SPECS <<<"${FO_FAULT_SPECS:---route peer --world 2;--route ring --world 3;--nccl;--nccl-world 2 --timeout-ms 500 --stall-s 2 --case-s 10}"
    for spec in "${SPECS[@]}"; do
      [ "$(left)" -gt 150 ] || { echo "fault probe $spec: no time left" | tee -a "$OUT/faults.log"; continue; }
      step "fault probe $spec" >>"$OUT/faults.log"
      TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 timeout "$(cap 100)" python3 "$REPO/examples/device/fault_probe.py" \
        $spec --limit-s 90 >>"$OUT/faults.log" 2>&1
      echo "fault probe $spec rc=$?" | tee -a "$OUT/faults.log"; grep "^fault probe:" "$OUT/faults.log" | tail -1
    done
  fi
elif [ "$PART" = B ]; then
  cpu_side &  # on the host's other cores while the GPU steps run
  CPU_PID=$!
  if [[ "$SKIP" != *" tests "* ]]; then
    step "GPU test rerun: ${FO_RERUN:-tests/test_gpu_moe.py tests/test_gpu_moe_peer.py tests/test_moe_plan_kernel.py tests/test_moe_plan_lib.py}"
    timeout "$(cap ${FO_RERUN_CAP_S:-120})" python3 -m pytest -q -rs -p no:cacheprovider $(for f in ${FO_RERUN:-tests/test_gpu_moe.py tests/test_gpu_moe_peer.py tests/test_moe_plan_kernel.py tests/test_moe_plan_lib.py}; \
      do echo "$REPO/$f"; done) >"$OUT/gpu_tests.log" 2>&1
    echo "gpu pytest rc=$?" | tee -a "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log"
  fi
  if [[ "$SKIP" != *" ops "* ]]; then
    step "bench_ops"; clocks_on
    OPS_CAP=$(cap "${FO_OPS_CAP_S:-120}")
    timeout "$OPS_CAP" "${TORCHRUN[@]}" --nproc_per_node="$WORLD" "$REPO/examples/bench_ops.py" --fuse auto \
      --shapes "${FO_OPS_SHAPES:-4096x4096x4096,16384x4096x4096}" ${FO_OPS_ARGS:-} --time-budget-s $((OPS_CAP > 90 ? OPS_CAP - 30 : 60)) --json /tmp/fo_probe/bench_ops.json >"$OUT/bench_ops.log" 2>&1
    echo "bench_ops rc=$?" | tee -a "$OUT/bench_ops.log"; tail -25 "$OUT/bench_ops.log"; clocks_off "$OUT/bench_ops.log"
  fi
  if [[ "$SKIP" != *" gather "* ]]; then
    step "bench_gather"; clocks_on
    timeout "$(cap ${FO_GATHER_CAP_S:-120})" "${TORCHRUN[@]}" --nproc_per_node="$WORLD" "$REPO/examples/bench_gather.py" \
      --shapes "${FO_GATHER_SHAPES:-4096x6144x4096,16384x4096x4096}" ${FO_GATHER_ARGS:-} --json /tmp/fo_probe/bench_gather.json >"$OUT/bench_gather.log" 2>&1
    echo "bench_gather rc=$?" | tee -a "$OUT/bench_gather.log"; tail -25 "$OUT/bench_gather.log"
    clocks_off "$OUT/bench_gather.log"
  fi
  if [[ "$SKIP" != *" scatter "* ]]; then  # reduce_scatter on 2 GPUs: the pull route's schedules against the peer route
    step "scatter_pull_bench"; clocks_on
    timeout "$(cap ${FO_SCATTER_CAP_S:-150})" "${TORCHRUN[@]}" --nproc_per_node=2 "$REPO/examples/device/scatter_pull_bench.py" \
      --shapes "${FO_SCATTER_SHAPES:-4096x4096x8192,4096x4096x14336,8192x8192x14336,16384x8192x14336,16384x4096x8192}" \
      --sum-shapes "${FO_SCATTER_SUM_SHAPES:-8192x4096x14336}" >"$OUT/scatter.log" 2>&1
    echo "scatter_pull_bench rc=$?" | tee -a "$OUT/scatter.log"; tail -9 "$OUT/scatter.log"; clocks_off "$OUT/scatter.log"
  fi
  if [[ "$SKIP" != *" moe "* ]]; then  # the MoE ops' P2P route: examples/bench_moe.py (FO_MOE_ARGS: e.g. --shapes)
    step "bench_moe"
    timeout "$(cap 150)" "${TORCHRUN[@]}" --nproc_per_node="$WORLD" "$REPO/examples/bench_moe.py" ${FO_MOE_ARGS:-} \
      --json /tmp/fo_probe/bench_moe.json >"$OUT/bench_moe.log" 2>&1
    echo "bench_moe rc=$?" | tee -a "$OUT/bench_moe.log"; tail -20 "$OUT/bench_moe.log"
  fi
  if [[ "$SKIP" != *" moeprof "* ]]; then  # where a fused MoE call's time goes: profiler tables; traces: $OUT/moe_traces.tgz
    step "moe_profile"
    timeout "$(cap 90)" "${TORCHRUN[@]}" --nproc_per_node=2 "$REPO/examples/device/moe_profile.py" \
      --shapes "${FO_MOEPROF_SHAPES:-qwen3:4096}" --plans "${FO_MOEPROF_PLANS:-blocks,blocks+deferred}" --cprofile 10 --sections 30 --trace /tmp/fo_probe \
      >"$OUT/moe_profile.log" 2>&1
    echo "moe_profile rc=$?" | tee -a "$OUT/moe_profile.log"; grep "^==" "$OUT/moe_profile.log"
    (cd /tmp/fo_probe && tar czf "$OUT/moe_traces.tgz" moe_*.json 2>/dev/null)
  fi
  if [[ "$SKIP" != *" push "* ]]; then  # would copy-engine pushes and stream memory operations start the gather's GEMMs at once?
    step "push_probe"
    timeout "$(cap 150)" python3 "$REPO/examples/device/push_probe.py" ${FO_PUSH_ARGS:-} >"$OUT/push_probe.log" 2>&1
    echo "push_probe rc=$?" | tee -a "$OUT/push_probe.log"; tail -9 "$OUT/push_probe.log"
  fi
  if [[ "$SKIP" != *" timeline "* ]]; then
    step "timeline"; clocks_on
    timeout "$(cap 120)" "${TORCHRUN[@]}" --nproc_per_node="${FO_TIMELINE_WORLD:-2}" -m flashoverlap_inductor.bench timeline \
      --shapes "${FO_TIMELINE_SHAPES:-8192x6144x4096}" --png "$OUT" ${FO_TIMELINE_ARGS:-} --json /tmp/fo_probe/timeline.json >"$OUT/timeline.log" 2>&1
    echo "timeline rc=$?" | tee -a "$OUT/timeline.log"; tail -30 "$OUT/timeline.log"; clocks_off "$OUT/timeline.log"
  fi
fi
if [ "$PART" = A ] || [ "$PART" = B ]; then
  while kill -0 "$CPU_PID" 2>/dev/null && [ "$(left)" -gt 5 ]; do sleep 2; done
  pkill -f "bench coverage" 2>/dev/null; pkill -f "tests/test_pass_gather.py" 2>/dev/null
  step "CPU side done"; grep -E "rc=|passed|failed|^coverage:" "$OUT/cpu_tests.log" "$OUT/coverage.log" 2>/dev/null
fi
if [ "$PART" = C ]; then
  if [[ "$SKIP" != *" e2e "* ]]; then
    step "e2e"; clocks_on
    E2E_CAP=$(cap 540)  # the run ends itself before the kill (25 s, or 40% of a short cap), counting from its launch
    E2E_BUDGET=$((E2E_CAP > 60 ? E2E_CAP - 25 : E2E_CAP * 6 / 10))
    timeout "$E2E_CAP" "${TORCHRUN[@]}" --nproc_per_node="$WORLD" -m flashoverlap_inductor.bench e2e --preset "${FO_E2E_PRESET:-llama3-8b}" \
      --layers "${FO_E2E_LAYERS:-8}" --plan "${FO_E2E_PLAN:-sp}" --workload "${FO_E2E_WORKLOAD:-train,prefill}" --seq "${FO_E2E_SEQ:-4096}" --batch 1 --steps 12 --warmup 2 \
      --backends "${FO_E2E_BACKENDS:-inductor,inductor+async-tp,flashoverlap,bound,inductor-ro,flashoverlap-ro}" ${FO_E2E_ARGS:-} \
      ${FO_E2E_TRACE:+--trace /tmp/fo_probe/traces} --time-budget-s "$E2E_BUDGET" --budget-start-unix "$(date +%s)" \
      --quiet --json "$OUT/e2e.json" >"$OUT/e2e.log" 2>&1
    echo "e2e rc=$?" | tee -a "$OUT/e2e.log"; tail -40 "$OUT/e2e.log"; clocks_off "$OUT/e2e.log"
    if [ -n "${FO_E2E_TRACE:-}" ]; then  # where each traced step's GPU idles, then the traces themselves
      timeout "$(cap 120)" python3 -m flashoverlap_inductor.bench.trace_summary /tmp/fo_probe/traces/*.json >"$OUT/trace_gaps.log" 2>&1
      (cd /tmp/fo_probe/traces && tar czf "$OUT/e2e_traces.tgz" ./*.json 2>/dev/null)
    fi
  fi
fi
step "done"
