#!/usr/bin/env bash
# all_gather -> GEMMs on one GPU, in two calls of < 9.5 min each (the machine stays warm between them, so B reuses A's
# build):
#   run(command="FO_PART=A bash examples/device/gather_session.sh", carry=["build/cutlass", ".whl"])
#   run(command="FO_PART=B bash examples/device/gather_session.sh", carry=["build/cutlass", ".whl"])
# A: build the library (its gather unit is new), then the GPU tests of the gather routes (the peer route with ranks
#    sharing the GPU, the NCCL route's stream schedule), the kernel tests, the pass / op CPU tests under this
#    machine's torch (2.11: its post-grad graphs), then examples/device/gather_probe.py on 2 and 4 ranks sharing the
#    GPU, and its per-shard GEMM timing (one process: timings that hold).
# B: the e2e harness: world 1 (llama3-8b, 1 layer: nothing to fuse, flashoverlap within noise of Inductor?) and 2
#    ranks sharing the GPU (--share-gpu: gloo, correctness only) on tiny-llama's sequence-parallel plan.
# $OUT (at most 8 files come back): install.log, gpus.txt, build.log, tests.log, cpu_tests.log, probes.log,
# gather_probe_timing.md; e2e_w1.log/json, e2e_share.log/json. FO_SKIP_BUILD=1: keep the library there is;
# FO_SKIP_TIMING=1: no timing table.
set -uo pipefail
PART=${FO_PART:-A}
OUT=${OUT:-/tmp/fo_out}; mkdir -p "$OUT" /tmp/fo_probe
if [ "$PART" = A ] && [ -z "${FO_SKIP_BUILD:-}" ]; then
  timeout 300 python3 -m flashoverlap_inductor.build -j "$(nproc)" --keep-going >"$OUT/build.log" 2>&1
  echo "build rc=$?" >>"$OUT/build.log"; tail -3 "$OUT/build.log"
fi
source examples/device/setup_env.sh
END=$((SECONDS + ${FO_BUDGET_S:-540}))
left() { echo $((END - SECONDS - 10)); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 1 ? l : 1) : $1 )); }
export OMP_NUM_THREADS=4 FO_PG_TIMEOUT_S=120 TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpus.txt" 2>&1
if [ "$PART" = A ]; then
  timeout "$(cap 200)" python3 -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gpu_gather.py" \
    "$REPO/tests/test_gpu_gather_nccl.py" "$REPO/tests/test_gpu_kernels.py" >"$OUT/tests.log" 2>&1
  echo "gpu pytest rc=$?" | tee -a "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -12
  (cd "$REPO" && timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider tests/test_pass_gather.py \
    tests/test_gather_cpu.py tests/test_pass_graphs.py tests/test_pass_sum.py >"$OUT/cpu_tests.log" 2>&1)
  rc=$?; echo "cpu pytest (torch $(python3 -c "import torch; print(torch.__version__)")) rc=$rc" | tee -a "$OUT/cpu_tests.log"
  tail -4 "$OUT/cpu_tests.log"
  for w in 2 4; do
    [ "$(left)" -gt 40 ] || break
    timeout "$(cap 120)" python3 "$REPO/examples/device/gather_probe.py" --world "$w" --no-timing \
      --out /tmp/fo_probe >>"$OUT/probes.log" 2>&1
    echo "probe world $w rc=$?" | tee -a "$OUT/probes.log"; tail -3 "$OUT/probes.log"
  done
  if [ -z "${FO_SKIP_TIMING:-}" ] && [ "$(left)" -gt 30 ]; then
    timeout "$(cap 150)" python3 "$REPO/examples/device/gather_probe.py" --timing-only --out /tmp/fo_probe \
      >>"$OUT/probes.log" 2>&1
    echo "timing rc=$?" | tee -a "$OUT/probes.log"; cp /tmp/fo_probe/gather_probe_timing.md "$OUT/" 2>/dev/null
  fi
else
  timeout "$(cap 240)" python3 -m flashoverlap_inductor.bench e2e --preset llama3-8b --layers 1 --plan sp \
    --workload train,prefill --seq 2048 --backends inductor,flashoverlap \
    --quiet --json "$OUT/e2e_w1.json" >"$OUT/e2e_w1.log" 2>&1
  echo "e2e world 1 rc=$?" | tee -a "$OUT/e2e_w1.log"; tail -20 "$OUT/e2e_w1.log"
  timeout "$(cap 400)" python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
    -m flashoverlap_inductor.bench e2e --share-gpu --preset tiny-llama --plan tp,sp --workload train,prefill \
    --backends eager,inductor,flashoverlap --fuse always --quiet --json "$OUT/e2e_share.json" \
    >"$OUT/e2e_share.log" 2>&1
  echo "e2e 2 ranks sharing the GPU rc=$?" | tee -a "$OUT/e2e_share.log"; tail -30 "$OUT/e2e_share.log"
fi
