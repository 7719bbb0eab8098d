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
# resource usage (registers, stack = spills) and the signal's SASS sequence of one configuration
cuobjdump -res-usage build/libflashoverlap_sm90.so >"$OUT/res.txt" 2>&1
obj=$(ls build/obj/gemm_coop_128x256x64_c2x1_bf16_nk.o 2>/dev/null)
[ -n "$obj" ] && cuobjdump -sass "$obj" | grep -n -B12 -A3 'RED' | head -80 >"$OUT/signal_sass.txt"

if [ -z "${FO_SKIP_TESTS:-}" ]; then
  timeout "$(left 200)" python3 -m pytest -q -rs tests/test_gpu_kernels.py >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -25 "$OUT/pytest.log"
fi
if [ -z "${FO_SKIP_BENCH:-}" ]; then
  timeout "$(left 400)" python3 examples/bench_gemm.py --json "$OUT/bench.json" ${FO_BENCH_ARGS:-} \
    >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -40 "$OUT/bench.log"
fi
echo "total $SECONDS s"
