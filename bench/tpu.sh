#!/usr/bin/env bash
# meshtx on a lent TPU chip, as ONE command that fits one 600-second call (tables and rows to $OUT/tpu.log, $OUT/tpu.jsonl):
#   here:   bash bench/fetch_wheels.sh --tpu       (wheels the TPU image lacks, for its Python 3.11, into .whl-tpu/)
#   there:  run(command="bash bench/tpu.sh", carry=[".whl-tpu"], timeout_s=600)
#           run(command="PART=2 bash bench/tpu.sh", carry=[".whl-tpu"], timeout_s=600)   # the second half
#           PART=3: follow-ups (batch 8 of GPT-J-6B, the plan's parts beside XLA's); PART=4: plan(prompt=) against XLA
#           PART=5: the training loss's share of a step (tpu.py loss) and `plan` against XLA at a second shape (4 × 512)
#           PART=6: full steps at shapes and meshes the plan's TPU rules were not chosen on (tpu_steps.py; v5e-8 compiled
#           for its topology from one chip); PART=7: LoRA steps (rank 8) on the v5e-8 at every mesh shape (about 7 minutes)
#           PART=8: meshtx.compiled.compiled_memory on the chip and for a v5e-8 topology, against PART 1-7's figures
#           PART=9, 10: every TPU step tests/test_sharding.py holds, compiled again (two halves; after a model change)
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
  # GPT-J-6B in bf16 on one 16 GB chip (Colab's TPU): decoding at batch 1 and 4 (at 16 × 384 tokens it needs 16.1 GB:
  # `plan` says no, and XLA agrees), a LoRA step at 1 × 2048; then `plan` against XLA for the families' presets
  step 150 row gptj-6b infer --batch 4 --new 256
  step 170 row gptj-6b lora --seq 2048
  step 200 plan gptj-6b llama-3.2-1b llama-3.2-3b qwen2.5-0.5b qwen2.5-1.5b pythia-1.4b --seq 2048
elif [ "${PART}" = 3 ]; then
  # follow-ups to the first two: batch 8 of 128 + 256 tokens, which `plan(prompt=)` says fits on the chip (16 does not),
  # and where the plan and XLA part for the small-model steps (the plan's parts beside XLA's arguments and temporaries)
  step 170 row gptj-6b infer --batch 8 --new 256
  step 150 plan qwen2.5-0.5b llama-3.2-1b pythia-1.4b --seq 2048
elif [ "${PART}" = 4 ]; then
  # `plan(prompt=)` against XLA's analysis of generate's prefill on the chip (on a CPU it was 1.00-1.12; never measured here)
  step 300 infer-plan gptj-6b llama-3.2-1b qwen2.5-0.5b pythia-1.4b --shapes 1x128x384,8x128x384,1x1792x2048
elif [ "${PART}" = 5 ]; then
  # how XLA:TPU holds the fused loss (a step at the full and half vocabulary; the loss alone), which the plan counts per
  # backend; then the plan's training steps at 4 × 512, a shape the calibration (1 × 2048) did not use
  step 300 loss qwen2.5-0.5b llama-3.2-1b pythia-1.4b qwen2.5-1.5b gptj-6b --seq 2048
  step 250 plan qwen2.5-0.5b llama-3.2-1b pythia-1.4b qwen2.5-1.5b llama-3.2-3b gptj-6b --seq 512 --batch 4
elif [ "${PART}" = 6 ]; then
  echo "## $(date +%T) tpu_steps.py" | tee -a "$LOG"
  timeout 100 python3 tpu_steps.py list '[["llama-3.2-3b", 1, 1024, "bfloat16", 12], ["mistral-7b", 1, 512, "bfloat16", 4], ["qwen2.5-7b", 2, 1024, "bfloat16", 3]]' 2>&1 | grep -E "^ROW|Error" | tee -a "$LOG"
  timeout 300 python3 tpu_steps.py aot '{"topology_name": "v5e:2x4"}' '[["qwen2.5-1.5b", 8, 2048, "bfloat16", 4, 2, null], ["llama-3.2-3b", 8, 2048, "bfloat16", 4, 2, null], ["llama-3.2-3b", 8, 1024, "bfloat16", 8, 1, null], ["gptj-6b", 16, 2048, "bfloat16", 8, 1, null], ["mistral-7b", 8, 2048, "bfloat16", 8, 1, null], ["pythia-6.9b", 8, 1024, "bfloat16", 2, 4, null], ["llama-3.1-8b", 8, 512, "bfloat16", 8, 1, null], ["qwen2.5-7b", 8, 256, "bfloat16", 8, 1, null], ["llama-3.2-3b", 8, 4096, "bfloat16", 2, 4, null]]' 2>&1 | grep -E "^ROW|Error" | tee -a "$LOG"
elif [ "${PART}" = 7 ]; then
  echo "## $(date +%T) tpu_steps.py aot, LoRA" | tee -a "$LOG"
  timeout 280 python3 tpu_steps.py aot '{"topology_name": "v5e:2x4"}' '[["gptj-6b",8,2048,"bfloat16",8,1,null,8],["gptj-6b",8,2048,"bfloat16",4,2,null,8],["gptj-6b",8,2048,"bfloat16",2,4,null,8],["gptj-6b",8,2048,"bfloat16",1,8,null,8],["gptj-6b",8,2048,"bfloat16",1,1,null,8],["llama-3.2-1b",8,2048,"bfloat16",8,1,null,8],["llama-3.2-1b",8,2048,"bfloat16",4,2,null,8],["llama-3.2-1b",8,2048,"bfloat16",1,8,null,8],["llama-3.2-1b",8,2048,"bfloat16",1,1,null,8],["qwen2.5-0.5b",8,2048,"bfloat16",4,2,null,8]]' 2>&1 | grep -E "^ROW|Error" | tee -a "$LOG"
  timeout 280 python3 tpu_steps.py aot '{"topology_name": "v5e:2x4"}' '[["llama-3.1-8b",8,2048,"bfloat16",8,1,null,8],["llama-3.1-8b",8,2048,"bfloat16",4,2,null,8],["llama-3.1-8b",8,2048,"bfloat16",1,8,null,8],["mistral-7b",8,2048,"bfloat16",8,1,null,8],["mistral-7b",8,2048,"bfloat16",1,8,null,8],["qwen2.5-7b",8,2048,"bfloat16",8,1,null,8],["qwen2.5-7b",8,2048,"bfloat16",2,4,null,8],["pythia-6.9b",8,2048,"bfloat16",2,4,null,8],["gptj-6b",16,2048,"bfloat16",4,2,null,8],["llama-3.2-3b",8,4096,"bfloat16",4,2,null,8]]' 2>&1 | grep -E "^ROW|Error" | tee -a "$LOG"
elif [ "${PART}" = 9 ] || [ "${PART}" = 10 ]; then
  # every TPU step tests/test_sharding.py holds, compiled again for its topology (after a model change), 6 processes at
  # once on the host's cores: PART=9 the first half, PART=10 the second
  echo "## $(date +%T) tpu_steps.py tables" | tee -a "$LOG"
  timeout 570 python3 tpu_steps.py tables 6 "$((PART - 9))/2" 2>&1 | grep -E "^ROW|Error" | tee -a "$LOG"
elif [ "${PART}" = 8 ]; then
  echo "## $(date +%T) tpu_steps.py compiled" | tee -a "$LOG"
  timeout 400 python3 tpu_steps.py compiled '[["gptj-6b","lora",1,2048,"bfloat16",1,1,8,null,13.156],["qwen2.5-0.5b","train",1,2048,"bfloat16",1,1,0,null,4.877],["llama-3.2-1b","train",4,512,"bfloat16",1,1,0,null,11.457],["gptj-6b","lora",8,2048,"bfloat16",8,1,8,"v5e:2x4",3.587],["gptj-6b","lora",8,2048,"bfloat16",1,8,8,"v5e:2x4",8.733],["gptj-6b","train",8,2048,"bfloat16",8,1,0,"v5e:2x4",8.137],["llama-3.2-1b","train",8,2048,"bfloat16",4,2,0,"v5e:2x4",2.549]]' 2>&1 | grep -E "^ROW|Error" | tee -a "$LOG"
  timeout 150 python3 -c 'from meshtx.cli import main; main(["plan", "--preset", "gptj-6b", "--mode", "lora", "--lora-rank", "8", "--batch", "8", "--seq", "2048", "--devices", "8", "--fsdp", "8", "--topology", "v5e:2x4"])' 2>&1 | grep -v -E "^(W|I)[0-9]{4} " | tee -a "$LOG"
else
  # every family on the chip against the CPU (compiling tiny programs is slow on a TPU: about 40 s a variant)
  step 330 parity --quick
  step 100 row llama-3.2-1b infer --batch 16 --new 256
  step 130 row llama-3.2-1b train --seq 2048
fi
echo "## $(date +%T) done" | tee -a "$LOG"
