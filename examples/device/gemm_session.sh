#!/usr/bin/env bash
# One GPU-machine session for the sm90 signal-GEMM: (re)build, GPU tests, benchmark. Logs and JSON go to $OUT.
#
# Run from the repository root on the device (the `run` tool), carrying the CUTLASS headers made here with
#   python -m flashoverlap_inductor.build --copy-cutlass build/cutlass
# e.g. run(command="bash examples/device/gemm_session.sh", carry=["build/cutlass"], kind="nvidia-h200")
# or carrying a built library instead (carry=["build/libflashoverlap_sm90.so"]; then nothing is compiled).
#
# Environment knobs: FO_BUILD_ARGS (extra build flags, e.g. "--configs coop_*"), FO_BENCH_ARGS (bench flags),
# FO_SKIP_TESTS=1, FO_SKIP_BENCH=1, FO_BUDGET_S (wall seconds for the whole script, default 540).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fo_out}
mkdir -p "$OUT"
END=$((SECONDS + ${FO_BUDGET_S:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && echo "$1" || echo $((l > 5 ? l : 5)); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit \
  --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$OUT/env.txt"

if [ ! -f build/libflashoverlap_sm90.so ] || [ -n "${FO_BUILD_ARGS:-}" ]; then
  t0=$SECONDS
  timeout "$(left 330)" python3 -m flashoverlap_inductor.build --keep-going -j "$(nproc)" ${FO_BUILD_ARGS:-} \
    >"$OUT/build.log" 2>&1
  echo "build rc=$? in $((SECONDS - t0)) s: $(grep -c '^built' "$OUT/build.log") built," \
    "$(grep -c '^FAILED' "$OUT/build.log") failed"
  grep '^FAILED' "$OUT/build.log"
  grep -m3 -A3 'error' "$OUT/build.log" | head -20
fi
ls -la build/libflashoverlap_sm90.so && cp build/libflashoverlap_sm90.so "$OUT/" 2>/dev/null
if [ -n "${FO_SASS:-}" ]; then  # registers / stack (spills) per kernel, and the signal's SASS sequence
  cuobjdump -res-usage build/libflashoverlap_sm90.so >"$OUT/res.txt" 2>&1
  obj=$(ls build/obj/gemm_coop_128x256x64_c2x1_e128x64_bf16_nk.o 2>/dev/null)
  [ -n "$obj" ] && cuobjdump -sass "$obj" | grep -n -B40 -A3 'REDG' | grep -v '^[0-9]*-  *\/\* 0x' | head -120 \
    >"$OUT/signal_sass.txt"
fi
# SM clock, power and temperature every 0.5 s while the tests and the benchmark run
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 500 \
  >"$OUT/smi.csv" 2>&1 &
SMI_PID=$!

if [ -z "${FO_SKIP_TESTS:-}" ]; then
  timeout "$(left 200)" python3 -m pytest -q -rs tests/test_gpu_kernels.py >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -25 "$OUT/pytest.log"
fi
if [ -z "${FO_SKIP_BENCH:-}" ]; then
  timeout "$(left 400)" python3 examples/bench_gemm.py --json "$OUT/bench.json" ${FO_BENCH_ARGS:-} \
    >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -v "^# " "$OUT/bench.log" | tail -70
fi
kill "$SMI_PID" 2>/dev/null
python3 - "$OUT/smi.csv" <<'PY'
import statistics, sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 3]
clk = [float(r[1].split()[0]) for r in rows if r[1].split()[0].replace(".", "").isdigit()]
pw = [float(r[2].split()[0]) for r in rows if r[2].split()[0].replace(".", "").isdigit()]
if clk and pw:
    print(f"smi: SM clock MHz median {statistics.median(clk):.0f} min {min(clk):.0f}; power W median "
          f"{statistics.median(pw):.0f} max {max(pw):.0f} ({len(clk)} samples)")
PY
echo "total $SECONDS s"
