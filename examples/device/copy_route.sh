#!/usr/bin/env bash
# Device script (nvidia-h200-x4, or -x2 without the 4-GPU part): the copy route of reduce_scatter
# (flashoverlap_inductor/copy_route.py): its GPU test on 2 GPUs, then examples/bench_ops.py for reduce_scatter with
# the NCCL route (C and Python host loops) and the copy route side by side, on all GPUs and on 2.
# Writes $OUT/copy_tests.log, $OUT/bench_copy_w<W>.json|log.
source examples/device/setup_env.sh
W=$(nvidia-smi -L | wc -l)
V=${FO_VARIANTS:-tiles/direct/python,tiles/direct/python////copy}
R=(python3 -m torch.distributed.run --standalone)
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gpu_ops.py" \
  -k "copy_route or (test_ops_match_eager and reduce_scatter)" >"$OUT/copy_tests.log" 2>&1
echo "copy tests rc=$?" >>"$OUT/copy_tests.log"
for w in $W 2; do
  [ "$w" -le "$W" ] || continue
  [ "$w" = 2 ] && [ "$W" = 2 ] && [ -f "$OUT/bench_copy_w2.json" ] && continue
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((w - 1))) timeout 280 "${R[@]}" --nproc_per_node="$w" \
    "$REPO/examples/bench_ops.py" --ops reduce_scatter --fused-variants "$V" --time-budget-s 200 \
    --json "$OUT/bench_copy_w$w.json" ${FO_ARGS:-} >"$OUT/bench_copy_w$w.log" 2>&1
  echo "bench w$w rc=$?" >>"$OUT/bench_copy_w$w.log"
done
tail -n 3 "$OUT/copy_tests.log"; grep -h -E "variant|geomean|rc=" "$OUT"/bench_copy_w*.log
