#!/usr/bin/env bash
# Issue 4 on one nvidia-h200-x4 machine: GPU tests of the overlapped ops (2 ranks), the op benchmark on 4 and 2
# GPUs, the NCCL bandwidth tuner on 4 and 2 GPUs (quick) and, if time is left, one plan search. Ends in < 9.5 min.
#
# Run from the repository root, carrying the built library:
#   run(command="bash experiments/device/issue4_run.sh", carry=["build/libflashoverlap_sm90.so"], kind="nvidia-h200-x4")
# Files in $OUT (8 at most, <= 2 levels): run.log (every step's output), summary.txt, bench_w4.json/.png,
# bench_w2.json/.png, bandwidth_h200.json (the shipped curves with worlds 4 and 2 re-measured),
# plans/h200_w4.json (the search's tuned plan).
# Knobs: FO_BUDGET_S (whole script, default 555 s), FO_SKIP="tests bench4 bench2 bw4 bw2 search" (any subset),
# FO_BENCH_ARGS (extra bench flags).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4 FO_PG_TIMEOUT_S=120 TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
REPO=$(pwd)
OUT=${OUT:-/tmp/fo_out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
export FLASHOVERLAP_LIB="$REPO/build/libflashoverlap_sm90.so"
END=$((SECONDS + ${FO_BUDGET_S:-555}))
SKIP=" ${FO_SKIP:-} "
STATUS=()
left() { local l=$((END - SECONDS - 15)); [ "$l" -gt "$1" ] && echo "$1" || echo $((l > 5 ? l : 5)); }
say() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
TORCHRUN=(python3 -m torch.distributed.run --standalone)

# step NAME CAP_S CMD...: run CMD with a timeout of min(CAP_S, time left), output appended to run.log
step() {
  local name=$1 cap=$2; shift 2
  if [[ "$SKIP" == *" $name "* ]]; then STATUS+=("$name: skipped (FO_SKIP)"); return; fi
  local limit; limit=$(left "$cap")
  if [ "$limit" -le 20 ]; then STATUS+=("$name: skipped (out of time)"); say "skip $name: out of time"; return; fi
  say "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  (cd /tmp/fo_cwd && timeout --kill-after=10 "$limit" "$@") 2>&1 | tee -a "$LOG"
  local rc=$?
  [ "$rc" -eq 124 ] && rc="124 (TIMEOUT)"
  STATUS+=("$name: rc=$rc in $((SECONDS - t0)) s")
  say "=== $name done: rc=$rc in $((SECONDS - t0)) s"
}

mkdir -p /tmp/fo_cwd  # python runs outside the repo, so the repo's flashoverlap_inductor/ never shadows the install
say "host: $(nproc) cores; repo $REPO"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
nvidia-smi topo -m 2>&1 | head -8 | tee -a "$LOG"
ls -la "$FLASHOVERLAP_LIB" 2>&1 | tee -a "$LOG" || say "WARNING: no built library: the fused path will be off"

# --- the package: editable install (offline) or, failing that, a symlinked package tree on PYTHONPATH
CHECK='import flashoverlap_inductor.cost_model, flashoverlap_inductor.passes, flashoverlap_inductor.configs, torch
from flashoverlap_inductor.native import kernels
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "overlapped path", kernels.available())'
if ! (cd /tmp/fo_cwd && python3 -c "$CHECK") >>"$LOG" 2>&1; then
  say "installing the package (pip install -e . --no-deps --no-build-isolation)"
  timeout 120 python3 -m pip install -q -e "$REPO" --no-deps --no-build-isolation >>"$LOG" 2>&1 \
    || say "pip install failed (see above)"
fi
if ! (cd /tmp/fo_cwd && python3 -c "$CHECK") >>"$LOG" 2>&1; then
  say "falling back to a symlinked package tree on PYTHONPATH"
  PKG=/tmp/fo_pkg/flashoverlap_inductor
  rm -rf /tmp/fo_pkg && mkdir -p "$PKG"
  for f in "$REPO"/flashoverlap_inductor/*; do ln -s "$f" "$PKG/"; done
  ln -sfn "$REPO/cost_model" "$PKG/cost_model"; ln -sfn "$REPO/passes" "$PKG/passes"
  ln -sfn "$REPO/configs" "$PKG/configs"
  export PYTHONPATH=/tmp/fo_pkg${PYTHONPATH:+:$PYTHONPATH}
fi
(cd /tmp/fo_cwd && python3 -c "$CHECK") 2>&1 | tee -a "$LOG"

# --- steps, most important first
step tests 210 python3 -m pytest -v -rs -p no:cacheprovider "$REPO/tests/test_gpu_ops.py" "$REPO/tests/test_gpu_kernels.py"
step bench4 170 "${TORCHRUN[@]}" --nproc_per_node=4 "$REPO/examples/bench_ops.py" --json "$OUT/bench_w4.json" \
  --png "$OUT/bench_w4.png" --time-budget-s "$(( $(left 170) - 45 ))" ${FO_BENCH_ARGS:-}
step bench2 130 "${TORCHRUN[@]}" --nproc_per_node=2 "$REPO/examples/bench_ops.py" --json "$OUT/bench_w2.json" \
  --png "$OUT/bench_w2.png" --time-budget-s "$(( $(left 130) - 40 ))" ${FO_BENCH_ARGS:-}
step bw4 50 "${TORCHRUN[@]}" --nproc_per_node=4 -m flashoverlap_inductor.tune bandwidth --quick \
  --out "$OUT/bandwidth_h200.json"
step bw2 45 "${TORCHRUN[@]}" --nproc_per_node=2 -m flashoverlap_inductor.tune bandwidth --quick \
  --out "$OUT/bandwidth_h200.json"
step search 50 "${TORCHRUN[@]}" --nproc_per_node=4 -m flashoverlap_inductor.tune search --collective all_reduce \
  --shape 8192x8192x8192 --mode both --max-units 6 --rounds 3 --out-dir "$OUT"

# --- summary
{
  echo "issue 4 device run, $(date -u +%FT%TZ), ${SECONDS}s"
  printf '  %s\n' "${STATUS[@]}"
  grep -E "tests/test_gpu_ops.py::.* (PASSED|FAILED|ERROR|SKIPPED)" "$LOG" | sed 's/^.*test_gpu_ops.py::/  /' || true
  grep -E "^=+ .*(passed|failed|skipped|error).* in [0-9.]+s" "$LOG" | head -3 || true
  python3 - "$OUT" <<'EOF'
import json, math, sys
from pathlib import Path
out = Path(sys.argv[1])
for world in (4, 2):
    p = out / f"bench_w{world}.json"
    if not p.is_file():
        print(f"bench w{world}: no result"); continue
    doc = json.loads(p.read_text()); s = doc.get("summary", {})
    print(f"bench w{world}: {len(doc.get('rows', []))} rows, {doc['meta'].get('elapsed_s', '?')} s"
          f"{', CUT: ' + doc['meta']['cut'] if doc['meta'].get('cut') else ''}; overlapped path "
          f"{doc['meta'].get('available')} ({doc['meta'].get('routing')})")
    for op, a in s.get("ops", {}).items():
        f = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) and x is not None else str(x)
        print(f"  {op:15s} geomean {f(a.get('geomean_speedup'))} (ideal {f(a.get('geomean_ideal_speedup'))}, "
              f"chunked {f(a.get('geomean_chunked_speedup'))}, asyncTP {f(a.get('geomean_asynctp_speedup'))}) "
              f"min {f(a.get('min_speedup'))} 8192^3 {f(a.get('speedup_8192'))} auto/seq {f(a.get('worst_auto_ratio'))}"
              f" err {f(a.get('median_err_fused'))} unfused {a.get('unfused')} wrong {a.get('wrong')}")
    for name, c in s.get("checks", {}).items():
        print(f"  [{'PASS' if c['pass'] else 'FAIL'}] {name}: {c['value']} (target {c['target']})")
bw = out / "bandwidth_h200.json"
print(f"bandwidth: {'worlds ' + ','.join(json.loads(bw.read_text())['curves']) if bw.is_file() else 'no file'}")
for p in sorted((out / "plans").glob("*.json")) if (out / "plans").is_dir() else []:
    for e in json.loads(p.read_text())["entries"]:
        print(f"plan {p.name}: {e['collective']} {e['m']}x{e['n']}x{e['k']} w{e['world_size']}: fused "
              f"{e['measured_fused_ms']} ms vs seq {e['measured_seq_ms']} ms; {e['plan']}")
EOF
} 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
