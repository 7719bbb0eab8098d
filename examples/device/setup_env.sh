# Sourced by the device scripts, from the repository root: safe NCCL settings, $REPO/$OUT, the carried library,
# carried wheels (.whl: e.g. expecttest), an offline editable install, then cd to a scratch folder so the repo's
# own flashoverlap_inductor/ never shadows the install. Writes $OUT/install.log.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
REPO=$(pwd); OUT=${OUT:-/tmp/fo_out}; mkdir -p "$OUT" /tmp/fo_cwd
export FLASHOVERLAP_LIB=$REPO/build/libflashoverlap_sm90.so
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
timeout 120 python3 -m pip install -q -e "$REPO" --no-deps --no-build-isolation >"$OUT/install.log" 2>&1 \
  || echo "pip install -e failed" >>"$OUT/install.log"
cd /tmp/fo_cwd || exit 1
python3 -c "import flashoverlap_inductor.passes, torch; print('package ok, torch', torch.__version__)" \
  >>"$OUT/install.log" 2>&1
