#!/usr/bin/env bash
# Issue 7's device check, as ONE command for a lent NVIDIA H200: every benchmark at the GPT-J-6B shape in bf16,
# meshtx against HF transformers in the same process, tables to $OUT/gpu.log and rows to $OUT/gpu.jsonl.
#   here:   bash bench/fetch_wheels.sh
#   there:  run(command="bash bench/gpu.sh", carry=[".whl"], timeout_s=600)
# Each step has its own time limit so one slow step cannot eat the others; the whole script stays under 590 s
# (a last, conditional step may run past the 600-s call; everything before it is already in $OUT).
set -uo pipefail
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/..:${PYTHONPATH:-}"
if ls ../.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
OUT="${OUT:-/tmp/meshtx-bench}"; mkdir -p "$OUT"
PRESET="${PRESET:-gptj-6b}" SEQ="${SEQ:-2048}" PROMPT="${PROMPT:-128}" NEW="${NEW:-256}"
# PRESET=tiny SEQ=64 PROMPT=16 NEW=32 checks the script itself on a CPU (tiny's n_ctx is 128)
LOG="$OUT/gpu.log" JSON="$OUT/gpu.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c 'import json, common; print(json.dumps(common.environment()))' 2>&1 | tee -a "$LOG"
step() {  # step SECONDS SCRIPT ARGS...
  local limit=$1; shift
  echo "## $(date +%T) $* (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" python3 "$@" --preset "$PRESET" --json "$JSON" 2>&1 | grep -v -E '^(W|I)[0-9]{4} ' | tee -a "$LOG"
}
step 140 decode.py --repeats 1 --profile --compare-cache-reads --prompt "$PROMPT" --new "$NEW"
step 70  prefill.py --batch 4 --seq "$SEQ" --repeats 2
step 50  prefill.py --batch 4 --seq "$SEQ" --repeats 2 --attention cudnn --no-hf
step 110 train.py --batch 4 --seq "$SEQ" --checkpointing --repeats 2
step 60  train.py --batch 4 --seq "$SEQ" --checkpointing --remat-policy dots --attention cudnn --no-hf --repeats 2
step 70  lora.py --batch 1 --seq "$SEQ" --checkpointing --repeats 2
step 90  compile.py
# If the decode profile shows XLA copying each layer's weights out of the stacked parameters (dynamic-slice fusions
# among its costliest kernels), batch-1 decode reads every weight three times. Time it once more with XLA's
# dynamic-slice fusion, which lets the matmuls read the slices in place (off by default in XLA until at least mid-2026).
if sed -n '/decode.py/,/prefill.py/p' "$LOG" | grep -qi 'dynamic.slice'; then
  echo "(the decode profile shows dynamic-slice kernels: again with --xla_gpu_enable_dynamic_slice_fusion=true)" | tee -a "$LOG"
  ( export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true"; step 60 decode.py --repeats 1 --no-hf --batch 1 --prompt "$PROMPT" --new "$NEW" )
fi
echo "## $(date +%T) done" | tee -a "$LOG"
