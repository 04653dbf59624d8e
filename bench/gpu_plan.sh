#!/usr/bin/env bash
# `meshtx.plan` against XLA:GPU's memory analysis, on a machine WITHOUT a GPU (bench/gpu_plan.py: deviceless compiles).
# Installs JAX's CUDA plugin for the installed JAX (and ptxas) once into $CUDA_AOT (not into the environment: with it
# there, JAX would look for a GPU at every start), then compiles each row for an H100 (CHIP=h200, a100-80gb, l4, t4 too).
#   bash bench/gpu_plan.sh            # ~20 min on 2 CPU cores; rows to $OUT/gpu_plan.jsonl
# Its figures are tests/test_sharding.py's GPU_PREFILLS and GPU_STEPS (bench/RESULTS.md, 2026-12-06).
set -uo pipefail
cd "$(dirname "$0")"
CHIP="${CHIP:-h100}" OUT="${OUT:-/tmp/meshtx-bench}" CUDA_AOT="${CUDA_AOT:-$HOME/.cache/meshtx/cuda-aot}"
mkdir -p "$OUT"
V="$(python3 -c 'import jax; print(jax.__version__)')" || { echo "gpu_plan.sh: no JAX in this python3 (activate meshtx's environment)"; exit 1; }
if [ ! -f "$CUDA_AOT/.jax-$V" ]; then
  rm -rf "$CUDA_AOT" && python3 -m pip install -q --no-deps --target "$CUDA_AOT" "jax-cuda12-plugin==$V" "jax-cuda12-pjrt==$V" \
    nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12 nvidia-nvjitlink-cu12 && touch "$CUDA_AOT/.jax-$V" || exit 1
fi
export PYTHONPATH="$CUDA_AOT:$PWD/..:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
unset XLA_FLAGS
run() { python3 gpu_plan.py "${CHIP}" "$1" 2>&1 | grep -E "^ROW|Error" | sed 's/^ROW //' | tee -a "$OUT/gpu_plan.jsonl"; }
# generate's prefill on one GPU (bf16 weights)
run '[["infer","gptj-6b",1,128,2048],["infer","gptj-6b",8,512,2048],["infer","llama-3.1-8b",1,512,8192],["infer","llama-3.2-1b",16,256,4096],["infer","qwen2.5-0.5b",4,1024,4096],["infer","mistral-7b",2,2048,4096]]'
# training steps on one GPU: LoRA rank 8; full steps with bf16 moments, and with float32 weights and moments
run '[["lora","gptj-6b",1,2048,"bfloat16",1,1,null,1],["lora","gptj-6b",4,512,"bfloat16",1,1,null,1],["lora","llama-3.1-8b",1,2048,"bfloat16",1,1,null,1],["lora","llama-3.2-1b",4,2048,"bfloat16",1,1,null,1],["lora","qwen2.5-0.5b",1,2048,"bfloat16",1,1,null,1]]'
run '[["train","gptj-6b",1,2048,"bfloat16",1,1,null,1],["train","llama-3.2-1b",4,2048,"bfloat16",1,1,null,1],["train","qwen2.5-0.5b",1,2048,"bfloat16",1,1,null,1],["train","pythia-1.4b",8,512,"bfloat16",1,1,null,1],["train","llama-3.2-1b",1,2048,"float32",1,1,null,1],["train","qwen2.5-1.5b",2,1024,"float32",1,1,null,1]]'
# eight GPUs of one host at every mesh shape
run '[["train","gptj-6b",8,2048,"bfloat16",8,1,null,8],["train","gptj-6b",8,2048,"bfloat16",4,2,null,8],["train","gptj-6b",8,2048,"bfloat16",1,8,null,8],["train","llama-3.1-8b",8,2048,"float32",8,1,null,8],["train","llama-3.2-1b",8,2048,"bfloat16",4,2,null,8]]'
run '[["lora","gptj-6b",8,2048,"bfloat16",8,1,null,8],["lora","gptj-6b",8,2048,"bfloat16",2,4,null,8],["lora","llama-3.1-8b",8,2048,"bfloat16",1,8,null,8],["lora","llama-3.2-1b",8,2048,"bfloat16",4,2,null,8]]'
# measured after those rules were chosen
run '[["lora","qwen2.5-7b",1,4096,"bfloat16",1,1,null,1],["train","llama-3.2-3b",2,2048,"bfloat16",1,1,null,1],["train","mistral-7b",8,1024,"bfloat16",8,1,null,8],["lora","pythia-6.9b",8,2048,"bfloat16",2,4,null,8],["train","gptj-6b",8,512,"float32",8,1,null,8],["train","qwen2.5-1.5b",8,2048,"bfloat16",4,2,null,8],["infer","qwen2.5-7b",4,512,4096],["infer","pythia-1.4b",8,1024,2048]]'
CHIP=h200 run '[["train","gptj-6b",2,2048,"bfloat16",1,1,null,1]]'
CHIP=a100-80gb run '[["lora","llama-3.1-8b",2,2048,"bfloat16",1,1,null,1]]'
CHIP=l4 run '[["lora","llama-3.2-1b",1,2048,"bfloat16",1,1,null,1]]'
# a T4 has no bf16 arithmetic (XLA computes it in float32): the rows its rule was chosen on, then three after
CHIP=t4 run '[["infer","llama-3.2-1b",1,512,2048],["infer","qwen2.5-0.5b",4,512,2048],["infer","gptj-6b",1,128,1024],["lora","qwen2.5-0.5b",1,1024,"bfloat16",1,1,null,1],["lora","llama-3.2-1b",1,1024,"bfloat16",1,1,null,1],["lora","qwen2.5-0.5b",1,2048,"bfloat16",1,1,null,1],["train","qwen2.5-0.5b",1,512,"bfloat16",1,1,null,1],["lora","gptj-6b",1,512,"bfloat16",1,1,null,1]]'
CHIP=t4 run '[["lora","pythia-1.4b",1,2048,"bfloat16",1,1,null,1],["train","llama-3.2-1b",1,1024,"bfloat16",1,1,null,1],["infer","llama-3.2-3b",2,256,1024]]'
