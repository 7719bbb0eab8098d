#!/usr/bin/env bash
# torch-2.11 validation on a GPU machine of >= 2 GPUs: every test file (CPU files with xdist in the background, GPU
# files in the foreground), then the steady-state per-kernel diagnostic on all GPUs. < 6 minutes.
#   run(command="bash experiments/device/validate_211.sh", carry=["build/libflashoverlap_sm90.so", ".whl"],
#       kind="nvidia-h200-x4")
set -uo pipefail
source examples/device/setup_env.sh
(timeout 330 python3 -m pytest "$REPO/tests" -q -n 8 -p no:cacheprovider --ignore="$REPO/tests/test_gpu_ops.py" \
   --ignore="$REPO/tests/test_gpu_kernels.py" >"$OUT/tests_211.log" 2>&1; echo "pytest rc=$?" >>"$OUT/tests_211.log") &
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gpu_ops.py" "$REPO/tests/test_gpu_kernels.py" \
  >"$OUT/gpu_tests.log" 2>&1; echo "gpu pytest rc=$?" >>"$OUT/gpu_tests.log"
timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node="$(nvidia-smi -L | wc -l)" \
  "$REPO/experiments/device/steady.py" >"$OUT/steady.log" 2>&1; echo "steady rc=$?" >>"$OUT/steady.log"
wait
echo "=== GPU test files (torch 2.11):"; tail -3 "$OUT/gpu_tests.log"
echo "=== CPU test files (torch 2.11):"; grep -E "^(FAILED|ERROR)" "$OUT/tests_211.log"; tail -2 "$OUT/tests_211.log"
echo "=== steady state:"; grep -vE "Warning|warn|^\*|OMP_NUM" "$OUT/steady.log" | tail -30
