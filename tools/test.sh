#!/usr/bin/env bash
# Every test of meshtx, in the order a failure is cheapest to read:
#   1. the notebooks and the package agree (nbdev-export, nbdev-clean and the README change nothing)
#   2. the notebooks' lessons (nbdev-test)
#   3. the system tests (pytest tests/: two workers, then the `serial` ones alone)
#   4. the widget tests again under ipywidgets 7.7.1 (Colab's), the parity and tokenizer tests under
#      transformers 4.45 (the oldest allowed), then the parity, sharding and multi-host tests again under
#      JAX 0.7.2, the version on Colab's TPU image
#      (skip: MESHTX_SKIP_COMPAT=1)
set -euo pipefail
cd "$(dirname "$0")/.."
# 8 simulated CPU devices everywhere, so every mesh layout is tested on a laptop
user_xla_flags="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
# on 2 cores XLA's CPU collectives can deadlock; make a stuck one fail in seconds (flags unknown to jax 0.7.2)
export XLA_FLAGS="$user_xla_flags --xla_cpu_collective_call_warn_stuck_timeout_seconds=5 --xla_cpu_collective_call_terminate_timeout_seconds=10"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# most of the run is XLA compiling small programs: skip LLVM's costlier optimizations (JAX's own flag; measured on two
# cores: the system tests' sum 2877 -> 2359 s). It leaves XLA's HLO passes alone (jax/_src/compiler.py), and the tests
# of XLA's buffer figures pass as before. The code runs slower (the demo's training 113 -> 256 s), so tests/test_demo.py
# takes it back out.
export JAX_DISABLE_MOST_OPTIMIZATIONS="${JAX_DISABLE_MOST_OPTIMIZATIONS:-1}"

echo "== notebooks and package agree [at ${SECONDS}s]"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git ls-files -co --exclude-standard -z -- pyproject.toml nbs meshtx tools README.md | xargs -0 -I{} cp --parents {} "$tmp"
(cd "$tmp" && nbdev-export && nbdev-clean && python tools/readme.py)
for f in meshtx nbs README.md; do
  if ! diff -r -q -x __pycache__ "$f" "$tmp/$f"; then
    echo "FAIL: running nbdev-export / nbdev-clean / tools/readme.py changes $f: run them and commit"; exit 1
  fi
done

# one cache of compiled XLA programs for the whole run, fresh each run (MESHTX_CACHE_DIR=off: none): the notebooks, the
# tests and the CLI's processes compile many of the same programs. tests/conftest.py turns it on in the test processes,
# the CLI in its own; here JAX's own variables turn it on in the notebooks' kernels.
export MESHTX_CACHE_DIR="${MESHTX_CACHE_DIR:-$tmp/xla}"
jax_cache=()
if [ "$MESHTX_CACHE_DIR" != off ]; then
  jax_cache=(JAX_COMPILATION_CACHE_DIR="$MESHTX_CACHE_DIR" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0)
fi

echo "== notebook lessons (nbdev-test) [at ${SECONDS}s]"
env "${jax_cache[@]}" nbdev-test --n-workers 2

echo "== system tests (pytest): on both cores (pytest-xdist, a file per worker), then the serial ones alone [at ${SECONDS}s]"
python -m pytest tests -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" --durations=50
python -m pytest tests -q -m serial --durations=10

echo "== widgets again under ipywidgets 7.7.1 (Colab's version) [at ${SECONDS}s]"
ipyw="${MESHTX_IPYW771_DIR:-$HOME/.cache/meshtx/ipyw771}"
if [ ! -f "$ipyw/ipywidgets/_version.py" ] || ! grep -q "7, 7, 1" "$ipyw/ipywidgets/_version.py"; then
  rm -rf "$ipyw"
  python -m pip install -q --target "$ipyw" --no-deps ipywidgets==7.7.1 widgetsnbextension==3.6.10 jupyterlab_widgets==1.1.11 ipython_genutils==0.2.0
fi
PYTHONPATH="$ipyw" python -c 'import ipywidgets; assert ipywidgets.__version__ == "7.7.1", ipywidgets.__version__; print("ipywidgets", ipywidgets.__version__)'
PYTHONPATH="$ipyw" python -m pytest tests -q -m widgets

if [ "${MESHTX_SKIP_COMPAT:-0}" != 1 ]; then
  echo "== parity and tokenizer tests under transformers 4.45 (the oldest pyproject.toml allows) [at ${SECONDS}s]"
  tf4="${MESHTX_TF445_DIR:-$HOME/.cache/meshtx/tf445}"
  if [ ! -f "$tf4/transformers/__init__.py" ] || ! grep -q '__version__ = "4.45.0"' "$tf4/transformers/__init__.py"; then
    rm -rf "$tf4"; python -m pip install -q --target "$tf4" --no-deps transformers==4.45.0 tokenizers==0.20.3 huggingface_hub==0.36.0
  fi
  PYTHONPATH="$tf4" python -c 'import transformers; assert transformers.__version__ == "4.45.0"; print("transformers", transformers.__version__)'
  PYTHONPATH="$tf4" python -m pytest tests/test_parity.py tests/test_sampling.py tests/test_families.py -q -m transformers4   # (lm-eval needs a newer hub)

  echo "== parity, sharding and multi-host tests under jax 0.7.2 [at ${SECONDS}s]"
  overlay="${MESHTX_JAX072_DIR:-$HOME/.cache/meshtx/jax072}"
  if [ ! -f "$overlay/jax/version.py" ] || ! grep -q "_version = \"0.7.2\"" "$overlay/jax/version.py"; then
    rm -rf "$overlay"; python -m pip install -q --target "$overlay" --no-deps jax==0.7.2 jaxlib==0.7.2
  fi
  export XLA_FLAGS="$user_xla_flags"
  PYTHONPATH="$overlay" python -c 'import jax; assert jax.__version__ == "0.7.2", jax.__version__; print("jax", jax.__version__)'
  PYTHONPATH="$overlay" python -m pytest tests -q -n 2 --dist loadfile --no-loadscope-reorder -m "(parity or compat) and not serial"
  PYTHONPATH="$overlay" python -m pytest tests -q -m "(parity or compat) and serial"
fi
echo "== all tests passed [at ${SECONDS}s]"
