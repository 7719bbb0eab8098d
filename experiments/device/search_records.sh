#!/usr/bin/env bash
# Ranking data for `tune fit --records`: measured plan searches (`tune search --record`) on all GPUs of the machine,
# every candidate's times kept, one records file and one plans file per collective under $OUT.
#   run(command="bash experiments/device/search_records.sh", carry=["build/libflashoverlap_sm90.so", ".whl"],
#       kind="nvidia-h200-x2")
# Knobs: FO_JOBS ("<collective>@<budget s>:<MxNxK,...|grid> ...", run in turn), FO_BUDGET_S (default 560),
# FO_MAX_UNITS (default 6: 32 candidates a shape).
set -uo pipefail
source examples/device/setup_env.sh
END=$((SECONDS + ${FO_BUDGET_S:-560}))
W=$(nvidia-smi -L | wc -l)
LARGE_FIRST=16384x8192x8192,8192x8192x8192,16384x8192x7168,8192x8192x7168,4096x8192x8192,8192x8192x14336,\
16384x4096x4096,4096x8192x14336,8192x4096x4096,4096x8192x7168,16384x8192x14336,2048x8192x8192,4096x4096x4096,\
2048x8192x7168,2048x8192x14336,2048x4096x4096
JOBS=${FO_JOBS:-all_reduce@330:$LARGE_FIRST reduce_scatter@150:$LARGE_FIRST}
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpus.txt" 2>&1
for job in $JOBS; do
  head=${job%%:*}; shapes=${job#*:}; coll=${head%%@*}; budget=${head#*@}
  L=$((END - SECONDS - 20)); [ "$L" -gt 60 ] || break
  [ "$budget" -lt $((L - 40)) ] || budget=$((L - 40))
  timeout "$L" python3 -m torch.distributed.run --standalone --nproc_per_node="$W" -m flashoverlap_inductor.tune \
    search --collective "$coll" --shape "$shapes" --mode both --max-units "${FO_MAX_UNITS:-6}" --rounds 3 \
    --out-dir "$OUT" --record "$OUT/records_${coll}_w$W.json" --time-budget-s "$budget" \
    >"$OUT/search_${coll}_w$W.log" 2>&1
  echo "search $coll rc=$?" >>"$OUT/search_${coll}_w$W.log"
done
for f in "$OUT"/search_*.log; do echo "=== $f"; grep -E "tune search:|^best|rc=|Error|error" "$f" | tail -40; done
