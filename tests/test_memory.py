"""Loading streams: a float32 checkpoint of >= 400 MB loads into bf16 with peak RSS growth below 1.5x the bf16 size."""
import os, subprocess, sys, textwrap
import pytest

MAKE = textwrap.dedent("""
    import sys, torch, transformers
    from meshtx import ModelConfig
    cfg = ModelConfig(n_layer=6, d_model=1024, n_head=16, rotary_dim=32, n_vocab=50400, n_ctx=256)
    torch.manual_seed(0)
    transformers.GPTJForCausalLM(cfg.to_hf()).save_pretrained(sys.argv[1])
""")

LOAD = textwrap.dedent("""
    import sys, resource, json, psutil, jax, jax.numpy as jnp
    from meshtx.config import ModelConfig
    from meshtx.weights import load_hf_params
    cfg = ModelConfig.from_hf(sys.argv[1], param_dtype="bfloat16", compute_dtype="bfloat16")
    jnp.zeros(1).block_until_ready()
    base = psutil.Process().memory_info().rss
    params = load_hf_params(sys.argv[1], cfg, progress=False)
    jax.block_until_ready(params)
    # VmHWM: this process image's peak RSS (ru_maxrss would include the parent's, inherited across fork+exec)
    peak = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
    print(json.dumps({"growth": peak - base, "bf16": cfg.n_params * 2,
                      "dtype": str(params["gptj/wte"]["embedding"].dtype)}))
""")


@pytest.mark.slow
def test_bf16_load_peak_memory(tmp_path):
    import json
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one device, as a user's process has
    subprocess.run([sys.executable, "-c", MAKE, str(ckpt)], check=True, capture_output=True, timeout=600, env=env)
    fp32 = (ckpt / "model.safetensors").stat().st_size
    assert fp32 >= 400e6, fp32
    r = subprocess.run([sys.executable, "-c", LOAD, str(ckpt)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["dtype"] == "bfloat16"
    ratio = m["growth"] / m["bf16"]
    print(f"fp32 checkpoint {fp32 / 1e6:.0f} MB, bf16 params {m['bf16'] / 1e6:.0f} MB, peak RSS growth {m['growth'] / 1e6:.0f} MB = {ratio:.2f}x")
    assert ratio < 1.5, f"peak RSS grew {ratio:.2f}x the bf16 size"


LORA_TEMPS = textwrap.dedent("""
    import json, jax, jax.numpy as jnp
    from meshtx import ModelConfig, LoRAConfig
    from meshtx.model import gptj, split_layers
    from meshtx.lora import split_adapters
    from meshtx.train import make_optimizer, make_train_step, TrainState
    S, out = 256, {}
    for L in (2, 8):
        cfg = ModelConfig(n_layer=L, d_model=512, n_head=8, rotary_dim=32, n_vocab=1024, n_ctx=S,
                          param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
        lora = LoRAConfig(rank=8)
        frozen, trainable = split_adapters(jax.eval_shape(gptj(cfg, lora=lora).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
        opt = make_optimizer()
        state = TrainState(trainable, jax.eval_shape(opt.init, trainable), jax.ShapeDtypeStruct((), jnp.int32))
        one = lambda x, i: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)   # the frozen blocks one layer at a time, as on a CPU
        step = make_train_step(cfg, opt, None, lora).lower(state, jax.ShapeDtypeStruct((1, 1, S + 1), jnp.int32),
                                                           split_layers(frozen, one))
        out[L] = step.compile().memory_analysis().temp_size_in_bytes
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_unrolled_lora_step_remats():
    "A LoRA step over per-layer weights (the CPU's path) with remat keeps each block's input, not its activations."
    import json
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", LORA_TEMPS], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    t = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    per_layer = (t[8] - t[2]) / 6
    saved = 256 * 512 * 4            # one block's input, even in float32
    activations = 256 * (2 * 512 * 8 + 2 * 2048 * 6) + 8 * 256 * 256 * 6   # roughly what one block computes (~8 MB)
    assert per_layer <= 4 * saved, (f"each further block adds {per_layer / 1e6:.2f} MB of XLA temporaries: its "
                                    f"activations (~{activations / 1e6:.1f} MB) are kept, remat saved nothing", t)
