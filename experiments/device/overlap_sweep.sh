#!/usr/bin/env bash
# One call on nvidia-h200-x4: torch-2.11 test suite (CPU files in the background, GPU files in the foreground), a
# sweep of NCCL CTA caps x GEMM SM reserves for all_reduce on 4 GPUs, the full op benchmark on 4 and 2 GPUs with the
# best setting, and the README demo (NCCL, 2 GPUs). Ends in < 10 minutes.
#   run(command="bash experiments/device/overlap_sweep.sh", carry=["build/libflashoverlap_sm90.so", ".whl"],
#       kind="nvidia-h200-x4")
set -uo pipefail
source examples/device/setup_env.sh
export OMP_NUM_THREADS=4
SW=/tmp/fo_sweep; mkdir -p "$SW"
(timeout 360 python3 -m pytest "$REPO/tests" -q -n 8 -p no:cacheprovider --ignore="$REPO/tests/test_gpu_ops.py" \
   --ignore="$REPO/tests/test_gpu_kernels.py" >"$OUT/tests_211.log" 2>&1; echo "pytest rc=$?" >>"$OUT/tests_211.log") &
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gpu_ops.py" "$REPO/tests/test_gpu_kernels.py" \
  >"$OUT/gpu_tests.log" 2>&1; echo "gpu pytest rc=$?" >>"$OUT/gpu_tests.log"; tail -3 "$OUT/gpu_tests.log"

TR=(python3 -m torch.distributed.run --standalone)
SHAPES=8192x8192x8192,4096x8192x8192,16384x8192x8192,8192x4096x4096
best=""; bestv=0
for cfg in 0:16 4:6 8:10 12:14 16:18; do
  ctas=${cfg%%:*}; res=${cfg##*:}; extra=(); [ "$ctas" != 0 ] && extra=(--fused-max-ctas "$ctas")
  timeout 75 "${TR[@]}" --nproc_per_node=4 "$REPO/examples/bench_ops.py" --ops all_reduce --shapes "$SHAPES" \
    --rounds 3 --sm-reserve "$res" "${extra[@]}" --json "$SW/s_$ctas.json" >"$SW/s_$ctas.log" 2>&1
  v=$(python3 -c "import json;print(json.load(open('$SW/s_$ctas.json'))['summary']['ops']['all_reduce']['geomean_speedup'])" 2>/dev/null || echo 0)
  { echo "### max_ctas=$ctas sm_reserve=$res geomean=$v"; grep -A6 "^== all_reduce" "$SW/s_$ctas.log"; } | tee -a "$OUT/sweep.txt"
  if python3 -c "import sys; sys.exit(0 if float('$v') > float('$bestv') else 1)"; then best=$cfg; bestv=$v; fi
done
ctas=${best%%:*}; res=${best##*:}; extra=(); [ "${ctas:-0}" != 0 ] && extra=(--fused-max-ctas "$ctas")
echo "best: max_ctas=$ctas sm_reserve=$res ($bestv)" | tee -a "$OUT/sweep.txt"
for w in 4 2; do
  timeout 100 "${TR[@]}" --nproc_per_node=$w "$REPO/examples/bench_ops.py" --sm-reserve "${res:-16}" "${extra[@]}" \
    --time-budget-s 70 --json "$OUT/bench_w$w.json" >"$SW/b_$w.log" 2>&1
  grep -E "^== |geomean|\[(PASS|FAIL)\]" "$SW/b_$w.log" | tee -a "$OUT/sweep.txt"
done
wait
timeout 80 python3 -m flashoverlap_inductor.demo --fuse always >"$OUT/demo.log" 2>&1; echo "demo rc=$?" >>"$OUT/demo.log"
echo "=== torch 2.11 CPU suite:"; tail -3 "$OUT/tests_211.log"; echo "=== demo:"; tail -20 "$OUT/demo.log"
