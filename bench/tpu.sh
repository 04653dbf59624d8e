#!/usr/bin/env bash
# meshtx on a lent TPU chip, as ONE command that fits one 600-second call (tables and rows to $OUT/tpu.log, $OUT/tpu.jsonl):
#   here:   bash bench/fetch_wheels.sh --tpu       (wheels the TPU image lacks, for its Python 3.11, into .whl-tpu/)
#   there:  run(command="bash bench/tpu.sh", carry=[".whl-tpu"], timeout_s=600)
#           run(command="PART=2 bash bench/tpu.sh", carry=[".whl-tpu"], timeout_s=600)   # the second half
# Each step has its own time limit so one slow step cannot eat the others. One program at a time holds the chip.
set -uo pipefail
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
if ls ../.whl-tpu/*.whl >/dev/null 2>&1; then   # after the image's own packages: its JAX stays first
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ../.whl-tpu/*.whl && export PYTHONPATH="${PYTHONPATH:-}:/tmp/site"
fi
export PYTHONPATH="$PWD/..:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/meshtx-bench}"; mkdir -p "$OUT"
LOG="$OUT/tpu.log" JSON="$OUT/tpu.jsonl"
python3 -c 'import json, common; print(json.dumps(common.environment()))' 2>&1 | tee -a "$LOG"
step() {  # step SECONDS ARGS... (of bench/tpu.py)
  local limit=$1; shift
  echo "## $(date +%T) $* (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" python3 tpu.py "$@" --json "$JSON" 2>&1 | grep -v -E '^(W|I)[0-9]{4} ' | tee -a "$LOG"
}
if [ "${PART:-1}" = 1 ]; then
  step 170 parity
  step 150 row gptj-6b infer --batch 16 --new 256
  step 170 row gptj-6b lora --seq 2048
else
  step 150 plan gptj-6b llama-3.2-1b llama-3.2-3b qwen2.5-0.5b qwen2.5-1.5b pythia-1.4b --seq 2048
  step 100 row llama-3.2-1b infer --batch 16 --new 256
  step 110 row llama-3.2-1b train --seq 2048
  step 120 row mistral-7b infer --batch 8 --new 128
fi
echo "## $(date +%T) done" | tee -a "$LOG"
