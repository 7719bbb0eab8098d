#!/usr/bin/env bash
# Device script: experiments/device/zero_cta_probe.py on all GPUs with NCCL's default CTA policy and with
# NCCL_CTA_POLICY=2 (zero CTAs), the second with NCCL's INFO log filtered; writes $OUT/zero_*.json|log.
source examples/device/setup_env.sh
W=$(nvidia-smi -L | wc -l)
python3 - >"$OUT/nccl_strings.txt" 2>&1 <<'PY'
import glob, os, re
import nvidia.nccl as n
for lib in glob.glob(os.path.join(list(n.__path__)[0], "lib", "libnccl.so*")):
    data = open(lib, "rb").read()
    print(lib, sorted({m.decode() for m in re.findall(rb"NCCL_(?:CTA_POLICY|SYM[A-Z_]*|CE[A-Z_]*|WIN[A-Z_]*)", data)}))
    print(sorted({m.decode() for m in re.findall(rb"ncclAll[Tt]oAll[A-Za-z]*", data)}))
PY
P=$REPO/experiments/device/zero_cta_probe.py
R=(python3 -m torch.distributed.run --standalone --nproc_per_node="$W")
timeout 200 "${R[@]}" "$P" --json "$OUT/zero_default.json" >"$OUT/zero_default.log" 2>&1
mkdir -p /tmp/ncdbg
NCCL_CTA_POLICY=2 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,ENV NCCL_DEBUG_FILE=/tmp/ncdbg/n.%p.log \
  timeout 200 "${R[@]}" "$P" --json "$OUT/zero_policy2.json" >"$OUT/zero_policy2.log" 2>&1
cat /tmp/ncdbg/*.log | grep -i -E "alltoall|policy|cta| CE|copy engine|zero" | sed 's/^[^ ]* //' | sort | uniq -c \
  | sort -rn | head -40 >"$OUT/zero_info.txt"
cat "$OUT/nccl_strings.txt"; grep -h -E "^\{|Error|error" "$OUT"/zero_*.log | cut -c1-400; head -25 "$OUT/zero_info.txt"
