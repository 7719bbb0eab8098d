#!/usr/bin/env bash
# End-to-end benchmark recipe (docs/e2e.md): a TP / SP / EP HuggingFace model, trained and prefilled under eager,
# Inductor, Inductor + async-TP and flashoverlap side by side. Run from the repository root.
#
#   bash examples/e2e.sh            # CPU: 2 gloo ranks, the tiny presets, fuse=always (a correctness run, ~5 min on 2
#                                   #      cores; timings on CPU mean nothing)
#   FO_GPUS=8 bash examples/e2e.sh  # GPUs: llama3-8b tp+sp train+prefill, then qwen3-moe ep, on FO_GPUS GPUs
#
# Knobs: FO_GPUS (0 = CPU; else GPUs, one rank each), FO_LAYERS (llama3-8b depth, default 8), FO_MOE_LAYERS
# (qwen3-moe depth, default 8), FO_FUSE (auto|always; default auto on GPU, always on CPU), FO_STEPS (measured steps),
# OUT (results folder, default ./e2e_out). Exit status: 1 when any backend's losses or logits differ from Inductor's
# beyond the tolerance, or a backend failed.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
GPUS=${FO_GPUS:-0}
OUT=${OUT:-e2e_out}
mkdir -p "$OUT"
status=0

bench() {  # bench <nproc> <name> <args...>: one torchrun of the CLI, JSON and PNG under $OUT/<name>.*
  local nproc=$1 name=$2
  shift 2
  python3 -m torch.distributed.run --standalone --nproc_per_node="$nproc" -m flashoverlap_inductor.bench e2e \
    --json "$OUT/$name.json" --png "$OUT/$name.png" "$@" 2>&1 | tee "$OUT/$name.log" || status=1
}

if [ "$GPUS" = 0 ]; then
  export OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
  FUSE=${FO_FUSE:-always}
  STEPS=${FO_STEPS:-3}
  bench 2 cpu_dense --device cpu --preset tiny-llama,tiny-qwen3 --plan tp,sp --workload train,prefill \
    --seq 64 --steps "$STEPS" --fuse "$FUSE" --cache shared
  bench 2 cpu_moe --device cpu --preset tiny-moe --plan ep --workload train,prefill --seq 64 --steps "$STEPS" \
    --fuse "$FUSE" --cache shared
else
  FUSE=${FO_FUSE:-auto}
  STEPS=${FO_STEPS:-10}
  LAYERS=${FO_LAYERS:-8}
  MOE_LAYERS=${FO_MOE_LAYERS:-8}
  KV=()
  if [ "$GPUS" -gt 4 ]; then KV=(--kv-heads 8); fi  # Qwen3-30B-A3B has 4 kv heads
  bench "$GPUS" "llama3_8b_w$GPUS" --preset llama3-8b --layers "$LAYERS" --plan tp,sp --workload train,prefill \
    --seq 4096 --steps "$STEPS" --fuse "$FUSE"
  bench "$GPUS" "llama3_8b_prefill_w$GPUS" --preset llama3-8b --layers "$LAYERS" --plan tp,sp --workload prefill \
    --seq 2048,8192,16384 --steps "$STEPS" --fuse "$FUSE"
  bench "$GPUS" "qwen3_moe_w$GPUS" --preset qwen3-moe --layers "$MOE_LAYERS" ${KV[@]+"${KV[@]}"} --plan ep \
    --workload train,prefill --seq 4096 --steps "$STEPS" --fuse always --backends eager,inductor,flashoverlap
fi
echo "results in $OUT (exit status $status)"
exit $status
