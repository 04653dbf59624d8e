#!/usr/bin/env bash
# Every benchmark at one preset, one table each: bash bench/run_all.sh [--preset small] [other options]
set -euo pipefail
cd "$(dirname "$0")"
python -c 'import json, common; print(json.dumps(common.environment()))'
for b in decode prefill train lora compile memory; do python "$b.py" "$@"; done
