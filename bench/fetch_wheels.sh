#!/usr/bin/env bash
# Wheels the GPU image lacks (it has JAX, PyTorch, transformers, optax, peft, safetensors), for Python 3.12,
# into .whl/ at the repository root (ignored by git; carried to the device by `run(carry=[".whl"])`).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for pkg in dm-haiku==0.0.17 jmp==0.0.4 fastcore; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$pkg"
done
ls -la .whl
