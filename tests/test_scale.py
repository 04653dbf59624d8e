"""GPT-J-6B's own width (d_model 4096, 16 heads, d_ff 16384, vocabulary 50400) at 1 layer, in bf16: loading, a forward
pass and generation stay within a fixed margin of the weights' size (issue 19: the 28-layer model once needed 23–25 GB
of float32 copies beside its 12.1 GB of weights and ran out of memory). Memory only, never time: `bench/scale.py`
measures speed. Each step runs in a fresh process, so its peak RSS (VmHWM) is its own."""
import json, os, subprocess, sys, textwrap
import numpy as np
import pytest

WRITE = textwrap.dedent("""
    import sys, numpy as np
    from pathlib import Path
    from safetensors.numpy import save_file
    from meshtx import ModelConfig
    from meshtx.weights import hf_shapes
    cfg = ModelConfig.preset("gptj-6b", n_layer=1)
    rng, out = np.random.default_rng(0), Path(sys.argv[1])
    out.mkdir()
    shards = [{}, {}]   # two shards, as a hub checkpoint has several, float16 as GPT-J-6B's float16 revision
    for name, shape in hf_shapes(cfg).items():
        norm = "ln_" in name and name.endswith("weight")
        x = np.ones(shape, np.float16) if norm else (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
        shards["lm_head" in name or "ln_f" in name][name] = x
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for tensors, fn in zip(shards, names): save_file(tensors, out / fn, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: fn for tensors, fn in zip(shards, names) for k in tensors}}
    (out / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    hf = cfg.to_hf(); hf.torch_dtype = "float16"; hf.to_json_file(out / "config.json")
""")

RUN = textwrap.dedent("""
    import sys, json, numpy as np, jax
    def peak(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
    def rss(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
    from meshtx import LM
    jax.numpy.zeros(1).block_until_ready()
    base, what = rss(), sys.argv[2]
    lm = LM.from_hf(sys.argv[1], progress=False, tokenizer=None)
    jax.block_until_ready(lm.params)
    out = {"weights": sum(x.nbytes for x in jax.tree.leaves(lm.params)), "base": base, "load": peak() - base,
           "dtype": str(lm.params["gptj/wte"]["embedding"].dtype)}
    tokens = np.random.default_rng(1).integers(0, 50400, (1, 128))
    if what == "logits":
        params, layers = lm.weights()
        out["temp"] = lm._forward.lower(params, tokens.astype(np.int32), None, layers=layers).compile().memory_analysis().temp_size_in_bytes
        out["argmax"] = np.asarray(lm.logits(tokens)[0].argmax(-1)).tolist()
    else:
        g = lm.generate([tokens[0, :32].tolist()], max_new_tokens=8, temperature=0)
        out["tokens"] = g.tokens[0]
    out["peak"] = peak() - base
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 8e9: pytest.skip("needs 8 GB of memory")
    path = tmp_path_factory.mktemp("gptj6b-width") / "ckpt"
    subprocess.run([sys.executable, "-c", WRITE, str(path)], check=True, timeout=600, env=_env())
    return path


def _env():   # one CPU device, as a user's process has
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _run(checkpoint, what):
    r = subprocess.run([sys.executable, "-c", RUN, str(checkpoint), what], capture_output=True, text=True, timeout=900, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{what}: weights {m['weights'] / 1e9:.2f} GB; load peak +{m['load'] / 1e9:.2f} GB; overall peak +{m['peak'] / 1e9:.2f} GB")
    return m


@pytest.mark.slow
def test_6b_width_forward_memory(checkpoint):
    m = _run(checkpoint, "logits")
    GB, w = 1e9, m["weights"]
    assert m["dtype"] == "bfloat16" and 1.2 * GB < w < 1.3 * GB, m   # 614 M parameters in bf16
    assert m["load"] <= w + 0.5 * GB, f"loading peaked {m['load'] / GB:.2f} GB above the baseline, weights {w / GB:.2f} GB"
    assert m["temp"] <= 0.1 * w, f"the forward's XLA temporaries are {m['temp'] / GB:.2f} GB (a float32 copy of weights?)"
    assert m["peak"] <= w + 1.0 * GB, f"a 1 x 128 forward peaked {m['peak'] / GB:.2f} GB above the baseline"
    assert len(set(m["argmax"])) > 1   # the random model says something, not one token everywhere


@pytest.mark.slow
def test_6b_width_generate_memory(checkpoint):
    m = _run(checkpoint, "generate")
    GB, w = 1e9, m["weights"]
    assert len(m["tokens"]) == 8
    assert m["peak"] <= w + 1.0 * GB, f"generate peaked {m['peak'] / GB:.2f} GB above the baseline, weights {w / GB:.2f} GB"
