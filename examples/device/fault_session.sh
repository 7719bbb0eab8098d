#!/usr/bin/env bash
# The failure contract on one GPU, < 9.8 min on one nvidia-h100-x1 / nvidia-h200 machine: build the library (when
# no built one was carried), the kernel tests, the fault probes (examples/device/fault_probe.py: a stalled rank on
# the peer route (2 ranks) and the ring (3 ranks), eagerly and in a replayed CUDA graph; the NCCL route's wait
# giving up), the routes' correctness probes (ring_probe4.py, peer 2 and ring 3) and the host time of one fused
# call (peer_host_profile.py, 2 ranks): the fault kernel every call now ends with must not cost much.
#   run(command="bash examples/device/fault_session.sh", carry=["build/cutlass"], kind="nvidia-h100-x1")
# FO_SKIP: any of "tests faults probes host". FO_OLD / FO_OLD_LIB: see the host step.
# $OUT: install.log, build.log, gpu_tests.log, faults.log, probes.log, host.log.
set -uo pipefail
START=$SECONDS
if [ ! -f build/libflashoverlap_sm90.so ]; then
  timeout 360 python3 -m flashoverlap_inductor.build --keep-going -j "$(nproc)" >"${OUT:-/tmp}/build.log" 2>&1
  echo "build rc=$? in $((SECONDS - START)) s: $(grep -c '^FAILED' "${OUT:-/tmp}/build.log") failed" \
    | tee -a "${OUT:-/tmp}/build.log"
  grep -m5 -B2 -A5 ' error' "${OUT:-/tmp}/build.log" | head -40
fi
source examples/device/setup_env.sh
END=$((START + ${FO_BUDGET_S:-585}))
left() { echo $((END - SECONDS - 5)); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 1 ? l : 1) : $1 )); }
export OMP_NUM_THREADS=4
mkdir -p /tmp/fo_probe
SKIP=" ${FO_SKIP:-} "
if [[ "$SKIP" != *" tests "* ]]; then
  timeout "$(cap 90)" python3 -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gpu_kernels.py" \
    >"$OUT/gpu_tests.log" 2>&1
  echo "gpu pytest rc=$?" | tee -a "$OUT/gpu_tests.log"; tail -3 "$OUT/gpu_tests.log"
fi
[[ "$SKIP" == *" faults "* ]] || for spec in "--route peer --world 2" "--route ring --world 3" "--nccl"; do
  [ "$(left)" -gt 40 ] || { echo "fault probe $spec: no time left" | tee -a "$OUT/faults.log"; continue; }
  echo "=== fault probe $spec" >>"$OUT/faults.log"
  timeout "$(cap 150)" python3 "$REPO/examples/device/fault_probe.py" $spec --limit-s 120 >>"$OUT/faults.log" 2>&1
  echo "fault probe $spec rc=$?" | tee -a "$OUT/faults.log"; grep "^fault probe:" "$OUT/faults.log" | tail -1
done
[[ "$SKIP" == *" probes "* ]] || for spec in peer:2 ring:3; do
  route=${spec%%:*}; world=${spec##*:}
  [ "$(left)" -gt 60 ] || { echo "probe $spec: no time left" | tee -a "$OUT/probes.log"; continue; }
  timeout "$(cap 120)" python3 "$REPO/examples/device/ring_probe4.py" --world "$world" --route "$route" --queued 1 \
    --out /tmp/fo_probe >>"$OUT/probes.log" 2>&1
  echo "probe $spec rc=$?" | tee -a "$OUT/probes.log"
done
# host time per call against an older package (FO_OLD: its flashoverlap_inductor folder's parent, carried;
# FO_OLD_LIB: its library, carried), in one process, interleaved (host_ab.py); else this package alone
if [[ "$SKIP" == *" host "* ]]; then
  :
elif [ -n "${FO_OLD:-}" ] && [ "$(left)" -gt 60 ]; then
  rm -rf /tmp/fo_oldren && mkdir -p /tmp/fo_oldren && cp -r "$REPO/$FO_OLD/flashoverlap_inductor" /tmp/fo_oldren/fo_old
  grep -rl "flashoverlap" /tmp/fo_oldren/fo_old --include=*.py | xargs sed -i 's/flashoverlap_inductor/fo_old/g;
    s/torch\.ops\.flashoverlap\b/torch.ops.fo_old/g; s/NAMESPACE = "flashoverlap"/NAMESPACE = "fo_old"/'
  PYTHONPATH="/tmp/fo_oldren${PYTHONPATH:+:$PYTHONPATH}" timeout "$(cap 120)" python3 -m torch.distributed.run \
    --standalone --nproc_per_node=2 "$REPO/examples/device/host_ab.py" --old fo_old --old-lib "$REPO/$FO_OLD_LIB" \
    --backend gloo --shape 2048x4096x4096 >"$OUT/host.log" 2>&1
  echo "host A/B, peer route, 2 ranks, rc=$?" | tee -a "$OUT/host.log"; tail -12 "$OUT/host.log"
elif [ "$(left)" -gt 50 ]; then
  timeout "$(cap 80)" python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
    "$REPO/examples/device/peer_host_profile.py" --backend gloo --shape 2048x4096x4096 >"$OUT/host.log" 2>&1
  echo "host profile rc=$?" | tee -a "$OUT/host.log"; tail -15 "$OUT/host.log"
fi
echo "session done in $((SECONDS - START)) s"
