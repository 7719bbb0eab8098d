#!/usr/bin/env bash
# One validation call on nvidia-h200-x4 (torch 2.11): the whole CPU test suite in the background (xdist), the
# issue-4 script in the foreground (GPU tests of kernels and ops, op benchmarks on 4 and 2 GPUs, NCCL curve on
# 4 GPUs), then the README demo with NCCL on 2 GPUs. Ends in < 10 minutes.
#   run(command="bash examples/device/validate_x4.sh", carry=["build/libflashoverlap_sm90.so", ".whl"],
#       kind="nvidia-h200-x4")
# .whl holds expecttest (not on the GPU image): python3 -m pip download --no-deps expecttest==0.3.0 -d .whl
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_FX_GRAPH_CACHE=0
REPO=$(pwd)
OUT=${OUT:-/tmp/fo_out}
mkdir -p "$OUT" /tmp/fo_cwd
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
timeout 120 python3 -m pip install -q -e "$REPO" --no-deps --no-build-isolation >"$OUT/tests_211.log" 2>&1 \
  || echo "pip install -e failed" >>"$OUT/tests_211.log"
(cd /tmp/fo_cwd && timeout 400 python3 -m pytest "$REPO/tests" -q -n 8 -p no:cacheprovider \
   --ignore="$REPO/tests/test_gpu_ops.py" --ignore="$REPO/tests/test_gpu_kernels.py" >>"$OUT/tests_211.log" 2>&1;
 echo "pytest rc=$?" >>"$OUT/tests_211.log") &
FO_BUDGET_S=${FO_BUDGET_S:-430} FO_SKIP=${FO_SKIP:-"bw2 search"} bash "$REPO/examples/device/issue4_run.sh"
wait
(cd /tmp/fo_cwd && timeout 75 python3 -m flashoverlap_inductor.demo --fuse always) >"$OUT/demo.log" 2>&1
echo "demo rc=$?" >>"$OUT/demo.log"
echo "=== torch 2.11 CPU test suite:"; tail -4 "$OUT/tests_211.log"
echo "=== demo:"; tail -25 "$OUT/demo.log"
