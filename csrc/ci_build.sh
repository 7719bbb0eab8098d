#!/usr/bin/env bash
# CI step (called by .ci/run): compile the CUDA library (and the test helper library next to it) when nvcc is
# present, so compile errors never reach main.
# Default: the smoke build (2 translation units that cover both schedules, both dtypes and both B layouts; about
# 3 minutes on 2 cores). FO_CI_FULL=1 builds every configuration. Without nvcc it says why and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "from flashoverlap_inductor.build import find_nvcc; import sys; sys.exit(find_nvcc() is None)"; then
  echo "csrc/ci_build.sh: nvcc not found, skipping the CUDA library build"
  exit 0
fi
if [ "${FO_CI_FULL:-0}" = 1 ]; then
  exec "$PY" -m flashoverlap_inductor.build --require "$@"
fi
exec "$PY" -m flashoverlap_inductor.build --require --smoke --out-dir build/ci "$@"
