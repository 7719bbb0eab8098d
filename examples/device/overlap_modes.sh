#!/usr/bin/env bash
# Issue 4 on one nvidia-h200-x4 machine, < 9.5 min: the GPU tests (2 ranks on GPUs 0,1) beside a 2-GPU benchmark
# (GPUs 2,3), then the 4-GPU benchmark (on an -x2 machine: the tests, then the 2-GPU benchmark); every benchmark times, side by side, the fused path in each GEMM grid /
# NCCL route (FO_VARIANTS) next to all baselines.
#   run(command="bash examples/device/overlap_modes.sh", carry=["build/libflashoverlap_sm90.so", ".whl"],
#       kind="nvidia-h200-x4")
# Knobs: FO_SHAPES4 / FO_SHAPES2 (bench --shapes), FO_VARIANTS (bench --fused-variants), FO_ARGS (more bench
# flags), FO_WORLD (the wide benchmark's world size, default 8 on 8 GPUs, else 4), FO_TUNE=1 (tuner after the
# benchmarks), FO_SKIP ("tests bench2 bench4"), FO_BUDGET_S (default 560),
# FO_B2_BUDGET_S (the 2-GPU benchmark's --time-budget-s, default 240), FO_TESTS (test files, default the four
# GPU test files), FO_SHAPES2X (shapes of a second 2-GPU benchmark after the first, all_reduce and reduce_scatter,
# no variants: bench_w2x.json), FO_DEMO=1 (the README's demo on 2 GPUs at the end: demo.log), FO_DEMO_RO=1 (the demo
# with --mode reduce-overhead: demo_ro.log), FO_DEMO_ARGS (more demo flags, both runs).
# The ring route on 4 GPUs, beside the NCCL route: FO_VARIANTS="tiles/direct,tiles/peer////ring1,tiles/peer////ring2,
# tiles/peer////ring4" (bench_ops.with_mode); with FO_RING_FIT=1 the ring's cost model is then fitted to those
# variants (tune fit --ring --write into this machine's copy of configs/; ring_fit.log prints the section to commit)
# and, time left, the 4-GPU benchmark runs again with FLASHOVERLAP_RING=wide (its default and auto columns on the
# ring, auto deciding with the fitted terms: bench_w${W}_ring.json). Keep FO_SKIP="tests bench2" then: $OUT holds 8
# files (install.log, gpus.txt, bench_w$W.json/.png/.log, ring_fit.log, bench_w${W}_ring.json/.log), all that returns.
set -uo pipefail
source examples/device/setup_env.sh
END=$((SECONDS + ${FO_BUDGET_S:-560}))
SKIP=" ${FO_SKIP:-} "
VARIANTS=${FO_VARIANTS:-tiles/direct,persistent/direct}
SHAPES4=${FO_SHAPES4:-grid}
SHAPES2=${FO_SHAPES2:-grid}
export OMP_NUM_THREADS=4 FO_PG_TIMEOUT_S=120
TORCHRUN=(python3 -m torch.distributed.run --standalone)
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpus.txt" 2>&1
left() { echo $((END - SECONDS - 20)); }

NGPU=$(nvidia-smi -L | wc -l)
W=${FO_WORLD:-$((NGPU >= 8 ? 8 : 4))}  # the wide benchmark's world size: every GPU of an -x8 machine, else 4
B2GPUS=2,3
if [ "$NGPU" -lt 4 ]; then  # one pair of GPUs: tests first, then the 2-GPU benchmark on the same pair; no bench4
  B2GPUS=0,1
  SKIP="$SKIP bench4 "
fi
pids=()
if [[ "$SKIP" != *" tests "* ]]; then
  TESTS=()
  for t in ${FO_TESTS:-test_gpu_ops.py test_gpu_kernels.py test_gpu_peer.py test_gpu_ring.py}; do TESTS+=("$REPO/tests/$t"); done
  (CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" \
     >"$OUT/gpu_tests.log" 2>&1
   echo "gpu pytest rc=$?" >>"$OUT/gpu_tests.log") &
  pids+=($!)
  [ "$NGPU" -lt 4 ] && wait "${pids[@]}"
fi
if [[ "$SKIP" != *" bench2 "* ]]; then
  B2=${FO_B2_BUDGET_S:-240}
  (CUDA_VISIBLE_DEVICES=$B2GPUS timeout $((B2 + 60)) "${TORCHRUN[@]}" --master-port 29611 --nproc_per_node=2 \
     "$REPO/examples/bench_ops.py" --json "$OUT/bench_w2.json" --png "$OUT/bench_w2.png" --shapes "$SHAPES2" \
     --fused-variants "$VARIANTS" --time-budget-s "$B2" ${FO_ARGS:-} >"$OUT/bench_w2.log" 2>&1
   echo "bench2 rc=$?" >>"$OUT/bench_w2.log") &
  pids+=($!)
fi
wait "${pids[@]}" 2>/dev/null
if [ -n "${FO_SHAPES2X:-}" ]; then
  CUDA_VISIBLE_DEVICES=$B2GPUS timeout 180 "${TORCHRUN[@]}" --master-port 29612 --nproc_per_node=2 \
    "$REPO/examples/bench_ops.py" --json "$OUT/bench_w2x.json" --shapes "$FO_SHAPES2X" \
    --ops all_reduce,reduce_scatter --time-budget-s 90 >"$OUT/bench_w2x.log" 2>&1
  echo "bench2x rc=$?" >>"$OUT/bench_w2x.log"
fi
if [[ "${FO_DEMO:-0}" == 1 ]]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 420 python3 -m flashoverlap_inductor.demo ${FO_DEMO_ARGS:-} >"$OUT/demo.log" 2>&1
  echo "demo rc=$?" >>"$OUT/demo.log"
fi
if [[ "${FO_DEMO_RO:-0}" == 1 ]]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 420 python3 -m flashoverlap_inductor.demo --mode reduce-overhead \
    ${FO_DEMO_ARGS:-} >"$OUT/demo_ro.log" 2>&1
  echo "demo rc=$?" >>"$OUT/demo_ro.log"
fi
if [[ "$SKIP" != *" bench4 "* ]]; then
  L=$(left)
  timeout "$L" "${TORCHRUN[@]}" --nproc_per_node=$W "$REPO/examples/bench_ops.py" --json "$OUT/bench_w$W.json" \
    --png "$OUT/bench_w$W.png" --shapes "$SHAPES4" --fused-variants "$VARIANTS" --time-budget-s $((L - 50)) \
    ${FO_ARGS:-} >"$OUT/bench_w$W.log" 2>&1
  echo "bench4 rc=$?" >>"$OUT/bench_w$W.log"
fi
if [[ "${FO_RING_FIT:-0}" == 1 && -f "$OUT/bench_w$W.json" ]]; then
  python3 -m flashoverlap_inductor.tune fit --ring --bench "$OUT/bench_w$W.json" --write >"$OUT/ring_fit.log" 2>&1
  FIT_RC=$?
  echo "ring fit rc=$FIT_RC" >>"$OUT/ring_fit.log"
  L=$(left)
  if [ "$FIT_RC" = 0 ] && [ "$L" -gt 200 ]; then
    FLASHOVERLAP_RING=wide timeout "$L" "${TORCHRUN[@]}" --nproc_per_node=$W "$REPO/examples/bench_ops.py" \
      --json "$OUT/bench_w${W}_ring.json" --shapes "$SHAPES4" --fused-variants tiles/direct \
      --time-budget-s $((L - 50)) >"$OUT/bench_w${W}_ring.log" 2>&1
    echo "bench4 ring rc=$?" >>"$OUT/bench_w${W}_ring.log"
  fi
fi
# Tuner (FO_TUNE=1): NCCL curves on 4 and 2 GPUs, then measured plan searches (FO_SEARCH: "op:MxNxK ..." on 4 GPUs).
if [[ "${FO_TUNE:-0}" == 1 ]]; then
  for w in $W 2; do
    L=$(left); [ "$L" -gt 60 ] || break
    timeout $((L < 120 ? L : 120)) "${TORCHRUN[@]}" --nproc_per_node=$w -m flashoverlap_inductor.tune bandwidth \
      --out "$OUT/bandwidth_h200.json" >"$OUT/tune_bw$w.log" 2>&1; echo "bandwidth w$w rc=$?" >>"$OUT/tune_bw$w.log"
  done
  for job in ${FO_SEARCH:-all_reduce:8192x8192x8192}; do
    L=$(left); [ "$L" -gt 60 ] || break
    timeout $((L < 150 ? L : 150)) "${TORCHRUN[@]}" --nproc_per_node=$W -m flashoverlap_inductor.tune search \
      --collective "${job%%:*}" --shape "${job##*:}" --mode both --max-units 6 --rounds 3 --out-dir "$OUT" \
      >>"$OUT/tune_search.log" 2>&1; echo "search $job rc=$?" >>"$OUT/tune_search.log"
  done
fi
[ -f "$OUT/ring_fit.log" ] && { echo "=== ring fit"; grep -E "gemm_factor|fixed_ms|median|rc=" "$OUT/ring_fit.log"; }
[ -f "$OUT/bench_w${W}_ring.log" ] && { echo "=== bench w$W, FLASHOVERLAP_RING=wide"; tail -30 "$OUT/bench_w${W}_ring.log"; }
echo "=== GPU tests"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/gpu_tests.log" | tail -8
for w in 2 $W; do
  echo "=== bench w$w"; grep -vE "Warning|warn|^\*|OMP_NUM|^\s*$|^ +[0-9]+x" "$OUT/bench_w$w.log" 2>/dev/null | tail -40
done
[ -f "$OUT/bench_w2x.log" ] && { echo "=== bench w2x"; grep -E "^ +[0-9]+x|geomean|rc=" "$OUT/bench_w2x.log"; }
for d in demo demo_ro; do
  [ -f "$OUT/$d.log" ] && { echo "=== $d"; grep -E "fus|declin|ms|rc=|match|Error" "$OUT/$d.log" | tail -30; }
done
echo "=== tuner"; tail -2 "$OUT"/tune_bw*.log 2>/dev/null; grep -E "rc=|best|plan|wrote" "$OUT/tune_search.log" 2>/dev/null | tail -12
