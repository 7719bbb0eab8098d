#!/usr/bin/env bash
# Device script (nvidia-h200-x2): NCCL symmetric-window all_reduce beside a GEMM (experiments/device/window_probe.py),
# with NCCL's default CTA policy and with NCCL_CTA_POLICY=1 (efficiency), then one short run with NCCL's INFO log
# filtered to the lines that name symmetric kernels, windows or CTA policy. Writes $OUT/window_*.json|log.
source examples/device/setup_env.sh
python3 - >"$OUT/nccl_strings.txt" 2>&1 <<'PY'
import glob, os, re, torch
import nvidia.nccl as n
for lib in glob.glob(os.path.join(list(n.__path__)[0], "lib", "libnccl.so*")):
    data = open(lib, "rb").read()
    hits = sorted({m.decode() for m in re.findall(rb"NCCL_(?:CTA_POLICY|SYM[A-Z_]*|WIN[A-Z_]*)", data)})
    print(lib, hits)
print("torch nccl", torch.cuda.nccl.version())
PY
P=$REPO/experiments/device/window_probe.py
torchrun --nproc_per_node=2 "$P" --json "$OUT/window_default.json" >"$OUT/window_default.log" 2>&1
NCCL_CTA_POLICY=1 torchrun --nproc_per_node=2 "$P" --json "$OUT/window_eff.json" >"$OUT/window_eff.log" 2>&1
mkdir -p /tmp/ncdbg
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG,TUNING,ENV NCCL_DEBUG_FILE=/tmp/ncdbg/n.%p.log \
  torchrun --nproc_per_node=2 "$P" --rounds 1 --json "$OUT/window_dbg.json" >"$OUT/window_dbg.log" 2>&1
cat /tmp/ncdbg/*.log | grep -i -E "sym|window|cta|policy|AllReduce" | sort | uniq -c | sort -rn | head -80 \
  >"$OUT/nccl_info_filtered.txt"
tail -n 3 "$OUT"/window_*.log
