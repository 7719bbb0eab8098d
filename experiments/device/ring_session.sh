#!/usr/bin/env bash
# The ring route on one nvidia-h200-x2 machine, < 9.5 min: its GPU tests and the peer route's (2 ranks), the 4-rank
# correctness probe (4 processes on the 2 GPUs), then a 2-GPU benchmark timing the peer route and the ring in 1, 2
# and 4 rounds side by side with every baseline.
#   run(command="bash experiments/device/ring_session.sh", carry=["build/libflashoverlap_sm90.so", ".whl"],
#       kind="nvidia-h200-x2")
# Knobs: FO_SKIP ("tests probe bench"), FO_TESTS (test files, default test_gpu_ring.py test_gpu_peer.py),
# FO_SHAPES (bench --shapes, default grid), FO_VARIANTS (bench --fused-variants), FO_B_BUDGET_S (default 200).
set -uo pipefail
source examples/device/setup_env.sh
SKIP=" ${FO_SKIP:-} "
export OMP_NUM_THREADS=4 FO_PG_TIMEOUT_S=120
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpus.txt" 2>&1
if [[ "$SKIP" != *" tests "* ]]; then
  TESTS=()
  for t in ${FO_TESTS:-test_gpu_ring.py test_gpu_peer.py}; do TESTS+=("$REPO/tests/$t"); done
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" \
    >"$OUT/gpu_tests.log" 2>&1
  echo "gpu pytest rc=$?" >>"$OUT/gpu_tests.log"
fi
if [[ "$SKIP" != *" probe "* ]]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 "$REPO/examples/device/ring_probe4.py" --world 4 --out "$OUT" \
    >"$OUT/ring_probe4.log" 2>&1
  echo "probe rc=$?" >>"$OUT/ring_probe4.log"
fi
if [[ "$SKIP" != *" bench "* ]]; then
  B=${FO_B_BUDGET_S:-200}
  CUDA_VISIBLE_DEVICES=0,1 timeout $((B + 60)) python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
    "$REPO/examples/bench_ops.py" --json "$OUT/bench_ring_w2.json" --shapes "${FO_SHAPES:-grid}" \
    --ops all_reduce,reduce_scatter --fused-variants "${FO_VARIANTS:-tiles/peer////ring1,tiles/peer////ring2,tiles/peer////ring4}" \
    --time-budget-s "$B" >"$OUT/bench_ring_w2.log" 2>&1
  echo "bench rc=$?" >>"$OUT/bench_ring_w2.log"
fi
