#!/usr/bin/env bash
# TPU programs compiled on this machine, no TPU needed: libtpu (the version this JAX pins for `jax[tpu]`) is installed
# once into a cache dir, not into the environment; then tpu_steps.py's `compiled` rows run against TPU topologies:
#   bash bench/tpu_plan.sh '[["gptj-6b", "lora", 8, 2048, "bfloat16", 8, 1, 8, "v5e:2x4", 3.587], ...]'
#   (preset, mode, batch, seq, dtype, fsdp, mp, LoRA rank, topology: "v5e:2x4" or "v5e:1x1", GiB measured before or null)
# JAX's own backend stays the CPU (JAX_PLATFORMS=cpu); libtpu only compiles. Each result is a line `ROW {json}`.
# MESHTX_XLA_DUMP=DIR: XLA's dump of each program into DIR, for bench/xla_peak.py (which buffers set the peak).
set -euo pipefail
cd "$(dirname "$0")"
DIR="${MESHTX_LIBTPU:-$HOME/.cache/meshtx/libtpu}"
PIN=$(python -c 'import importlib.metadata as m; print(next(r.split(";")[0].replace(" ", "") for r in m.requires("jax") if r.startswith("libtpu")))')
[ -d "$DIR/libtpu" ] || python -m pip install -q --no-deps --target "$DIR" "$PIN"
PYTHONPATH="$DIR:$PWD/..:$PWD:${PYTHONPATH:-}" JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE="${TPU_ACCELERATOR_TYPE:-v5litepod-8}" \
  XLA_FLAGS="${MESHTX_XLA_DUMP:+--xla_dump_to=$MESHTX_XLA_DUMP}" python tpu_steps.py compiled "$1" 2>&1 | grep -E "^ROW|Error"
