#!/usr/bin/env bash
# What one GPU can check of the multi-rank routes, < 9.5 min on one nvidia-h200 (or nvidia-h100-x1) machine: the
# kernel tests, then the routes' correctness with several ranks as processes on the one GPU (gloo group, torch's
# symmetric memory mapping every rank's buffers; examples/device/ring_probe4.py): the peer route on 2 ranks, the ring
# on 2, 3 and 4, each with its queued stage of mixed shapes back to back; the ring's GEMM steps alone against
# torch.mm (examples/device/ring_profile.py --steps-only: timings that hold); then the host time of one fused call on
# 2 ranks (examples/device/peer_host_profile.py --backend gloo). Timings of the ranks' GPU work mean nothing here.
#   run(command="bash examples/device/one_gpu_session.sh", carry=["build/libflashoverlap_sm90.so"],
#       kind="nvidia-h200")
# Knobs: FO_SKIP ("tests probe steps host"), FO_PROBES (default "peer:2 ring:2 ring:3 ring:4"), FO_STEP_SHAPES
# (default "2048x8192x14336 2048x8192x8192 2048x4096x4096"), FO_HOST_SHAPE (default 2048x4096x4096), FO_OLD (an
# older checkout, carried: either its root or its flashoverlap_inductor folder, relative to the repository or
# absolute; the host profile also runs with that package, for a before/after in one run. The old package has the
# old API, so that run uses the old checkout's own examples/device/peer_host_profile.py: carry its examples/ too, or
# point FO_OLD_SCRIPT at an old copy of the script; FO_OLD_LIB: the library that package was built with, carried),
# FO_RING_HOST_WORLDS (default "2 4"), FO_BUDGET_S (default 560). With FO_OLD also host_ab.log (old and new in one
# process, interleaved). $OUT gets at most 8 files: install.log,
# gpus.txt, gpu_tests.log, probes.log (the probes' per-rank JSON stays in /tmp/fo_probe), steps.log, host_now.log,
# host_old.log, host_ab.log.
set -uo pipefail
source examples/device/setup_env.sh
END=$((SECONDS + ${FO_BUDGET_S:-560}))
left() { echo $((END - SECONDS - 10)); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 1 ? l : 1) : $1 )); }  # a step's timeout: its own or what is left
SKIP=" ${FO_SKIP:-} "
export OMP_NUM_THREADS=4 FO_PG_TIMEOUT_S=120
mkdir -p /tmp/fo_probe
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpus.txt" 2>&1
if [[ "$SKIP" != *" tests "* ]]; then
  timeout "$(cap 150)" python3 -m pytest -q -rs -p no:cacheprovider "$REPO/tests/test_gpu_kernels.py" \
    >"$OUT/gpu_tests.log" 2>&1
  echo "gpu pytest rc=$?" >>"$OUT/gpu_tests.log"
fi
if [[ "$SKIP" != *" probe "* ]]; then
  for spec in ${FO_PROBES:-peer:2 ring:2 ring:3 ring:4}; do
    route=${spec%%:*}; world=${spec##*:}
    [ "$(left)" -gt 30 ] || { echo "probe $route world $world: no time left" >>"$OUT/probes.log"; continue; }
    echo "=== probe $route world $world" >>"$OUT/probes.log"
    timeout "$(cap $((40 + 40 * world)))" python3 "$REPO/examples/device/ring_probe4.py" --world "$world" \
      --route "$route" --out /tmp/fo_probe >>"$OUT/probes.log" 2>&1
    echo "probe $route world $world rc=$?" | tee -a "$OUT/probes.log"
  done
  if [ "$(left)" -gt 60 ]; then  # a compiled TP MLP through the backend, 2 ranks on the GPU, the peer route
    echo "=== compiled TP probe" >>"$OUT/probes.log"
    timeout "$(cap 240)" python3 "$REPO/examples/device/compiled_tp_probe.py" >>"$OUT/probes.log" 2>&1
    echo "compiled TP probe rc=$?" | tee -a "$OUT/probes.log"
  fi
fi
if [[ "$SKIP" != *" steps "* ]]; then
  for shape in ${FO_STEP_SHAPES:-2048x8192x14336 2048x8192x8192 2048x4096x4096}; do
    [ "$(left)" -gt 30 ] || break
    timeout "$(cap 120)" python3 "$REPO/examples/device/ring_profile.py" --steps-only --shape "$shape" 2>&1 \
      | tee -a "$OUT/steps.log"
    echo "steps $shape rc=${PIPESTATUS[0]}" >>"$OUT/steps.log"
  done
fi
if [[ "$SKIP" != *" host "* ]]; then
  SHAPE=${FO_HOST_SHAPE:-2048x4096x4096}
  # one process, the NCCL route (an NCCL group of one rank): host times without a second process on the GPU
  timeout "$(cap 60)" python3 "$REPO/examples/device/host_profile.py" --shape "$SHAPE" >"$OUT/host_now.log" 2>&1
  echo "host profile (NCCL route, 1 rank) rc=$?" | tee -a "$OUT/host_now.log"
  timeout "$(cap 90)" python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
    "$REPO/examples/device/peer_host_profile.py" --backend gloo --shape "$SHAPE" >>"$OUT/host_now.log" 2>&1
  echo "host profile rc=$?" | tee -a "$OUT/host_now.log"
  timeout "$(cap 60)" python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
    "$REPO/examples/device/peer_host_profile.py" --backend gloo --no-gemm-cache --calls 200 --shape "$SHAPE" \
    >>"$OUT/host_now.log" 2>&1
  echo "host profile, GEMM cache off, rc=$?" | tee -a "$OUT/host_now.log"
  timeout "$(cap 60)" python3 "$REPO/examples/bench_gemm.py" --host-cost >>"$OUT/host_now.log" 2>&1
  echo "GEMM launch host cost rc=$?" | tee -a "$OUT/host_now.log"
  for w in ${FO_RING_HOST_WORLDS:-2 4}; do  # the ring's host time per call (its launches scale with the world)
    [ "$(left)" -gt 40 ] || break
    timeout "$(cap 90)" python3 -m torch.distributed.run --standalone --nproc_per_node="$w" \
      "$REPO/examples/device/peer_host_profile.py" --backend gloo --ring --calls 100 --shape "$SHAPE" \
      >>"$OUT/host_now.log" 2>&1
    echo "host profile ring world $w rc=$?" | tee -a "$OUT/host_now.log"
  done
  if [[ -n "${FO_OLD:-}" ]]; then
    old=$FO_OLD; [[ "$old" = /* ]] || old="$REPO/$old"
    old=${old%/}
    # The folder that holds the old package (goes on PYTHONPATH), whether FO_OLD names it or the package itself.
    if [[ -d "$old/flashoverlap_inductor" ]]; then old_root=$old; else old_root=$(dirname "$old"); fi
    old_script=${FO_OLD_SCRIPT:-}
    [[ -n "$old_script" && "$old_script" != /* ]] && old_script="$REPO/$old_script"
    if [[ -z "$old_script" ]]; then  # the old API needs the old script: the old checkout's own copy
      for cand in "$old_root/examples/device/peer_host_profile.py" "$old/../examples/device/peer_host_profile.py"; do
        [[ -f "$cand" ]] && { old_script=$cand; break; }
      done
    fi
    if [[ ! -d "$old_root/flashoverlap_inductor" ]]; then
      echo "FO_OLD=$FO_OLD: no flashoverlap_inductor package there" | tee "$OUT/host_old.log"
    elif [[ -z "$old_script" || ! -f "$old_script" ]]; then
      echo "FO_OLD=$FO_OLD: no old examples/device/peer_host_profile.py beside it (carry the old checkout's" \
        "examples/ or set FO_OLD_SCRIPT); the current script needs the new API" | tee "$OUT/host_old.log"
    else
      echo "old package $old_root/flashoverlap_inductor, script $old_script" >"$OUT/host_old.log"
      old_lib=$FLASHOVERLAP_LIB  # FO_OLD_LIB: the library the old package was built with (its ABI may differ)
      [[ -n "${FO_OLD_LIB:-}" ]] && { old_lib=$FO_OLD_LIB; [[ "$old_lib" = /* ]] || old_lib="$REPO/$old_lib"; }
      echo "old library $old_lib" >>"$OUT/host_old.log"
      PYTHONPATH="$old_root${PYTHONPATH:+:$PYTHONPATH}" FLASHOVERLAP_LIB="$old_lib" \
        timeout "$(cap 90)" python3 -m torch.distributed.run \
        --standalone --nproc_per_node=2 "$old_script" --backend gloo --shape "$SHAPE" >>"$OUT/host_old.log" 2>&1
      echo "host profile (old package) rc=$?" | tee -a "$OUT/host_old.log"
      # the two packages in one process, interleaved (host_ab.py): the old one renamed fo_old, ops torch.ops.fo_old
      rm -rf /tmp/fo_oldren && mkdir -p /tmp/fo_oldren && cp -r "$old_root/flashoverlap_inductor" /tmp/fo_oldren/fo_old
      grep -rl "flashoverlap" /tmp/fo_oldren/fo_old --include=*.py | xargs sed -i 's/flashoverlap_inductor/fo_old/g;
        s/torch\.ops\.flashoverlap\b/torch.ops.fo_old/g; s/NAMESPACE = "flashoverlap"/NAMESPACE = "fo_old"/'
      PYTHONPATH="/tmp/fo_oldren${PYTHONPATH:+:$PYTHONPATH}" timeout "$(cap 90)" python3 \
        "$REPO/examples/device/host_ab.py" --old fo_old --old-lib "$old_lib" --shape "$SHAPE" >>"$OUT/host_ab.log" 2>&1
      echo "host A/B, NCCL route, 1 rank, rc=$?" | tee -a "$OUT/host_ab.log"
      PYTHONPATH="/tmp/fo_oldren${PYTHONPATH:+:$PYTHONPATH}" timeout "$(cap 120)" python3 -m torch.distributed.run \
        --standalone --nproc_per_node=2 "$REPO/examples/device/host_ab.py" --old fo_old --old-lib "$old_lib" \
        --backend gloo --shape "$SHAPE" >>"$OUT/host_ab.log" 2>&1
      echo "host A/B, peer route, 2 ranks, rc=$?" | tee -a "$OUT/host_ab.log"
      old_single=$(dirname "$old_script")/host_profile.py
      if [[ -f "$old_single" ]]; then
        PYTHONPATH="$old_root${PYTHONPATH:+:$PYTHONPATH}" FLASHOVERLAP_LIB="$old_lib" \
          timeout "$(cap 60)" python3 "$old_single" --shape "$SHAPE" >>"$OUT/host_old.log" 2>&1
        echo "host profile (NCCL route, 1 rank, old package) rc=$?" | tee -a "$OUT/host_old.log"
      fi
    fi
  fi
fi
