#!/usr/bin/env bash
# Device script (nvidia-h200-x2): experiments/device/ring_probe.py on 2 GPUs; writes $OUT/ring_w2.json|log.
source examples/device/setup_env.sh
timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$REPO/experiments/device/ring_probe.py" \
  --json "$OUT/ring_w2.json" ${FO_RING_ARGS:-} >"$OUT/ring_w2.log" 2>&1
echo "ring rc=$?" >>"$OUT/ring_w2.log"
tail -4 "$OUT/ring_w2.log"
