"""One mesh for tensor, data and FSDP parallelism: the same numbers on every layout, each device its share."""
import json, math, os, subprocess, sys, textwrap
import numpy as np
import pytest
import jax
import optax
from meshtx import LM, ModelConfig, gptj, init_params
from meshtx.model import cross_entropy, KVCache, param_shapes
from meshtx.sharding import (make_mesh, param_shardings, activation_hint, batch_sharding, opt_state_shardings,
                             plan, kv_cache_shardings)
from test_parity import scaled_params

pytestmark = pytest.mark.compat   # also run under jax==0.7.2

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 1, 4), (2, 2, 2)]
# every split divides: n_head 8, d_model 64, d_ff 256, vocab 512 over 8 devices
CFG = ModelConfig(n_layer=2, d_model=64, n_head=8, rotary_dim=4, n_vocab=512, n_ctx=64)
OPT = optax.adamw(1e-4, weight_decay=0.1)


def test_eight_devices():
    assert len(jax.devices()) == 8


def make_step(model):
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(params)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


@pytest.fixture(scope="module")
def reference():
    params = scaled_params(init_params(CFG, 0), seed=0)
    params = jax.tree.map(lambda x: x * 0.5, params)   # logits O(1-10), gradients not saturated
    tokens = np.random.default_rng(0).integers(0, CFG.n_vocab, (8, 17)).astype(np.int32)
    host = jax.tree.map(np.asarray, params)
    logits = np.asarray(jax.jit(gptj(CFG).apply)(params, tokens[:, :-1]))
    new, _, loss = jax.jit(make_step(gptj(CFG)))(params, OPT.init(params), tokens)
    return host, tokens, logits, jax.tree.map(np.asarray, new), float(loss)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "dp%d-fsdp%d-mp%d" % s)
def test_mesh_matches_single_device(shape, reference):
    host, tokens, ref_logits, ref_params, ref_loss = reference
    mesh = mesh_of(shape)
    p_sh = param_shardings(CFG, mesh)
    params = jax.device_put(host, p_sh)
    model = gptj(CFG, activation_hint(mesh))
    batch = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))
    logits = jax.jit(model.apply)(params, batch[:, :-1])
    logits.block_until_ready()
    assert np.abs(ref_logits).max() > 1.0
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-5, rtol=0)

    o_sh = opt_state_shardings(OPT, params, p_sh, mesh)
    opt_state = jax.jit(OPT.init, out_shardings=o_sh)(params)
    step = jax.jit(make_step(model), out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1))
    new, opt_state, loss = step(params, opt_state, batch)
    loss.block_until_ready()   # block per step: queued CPU collectives can deadlock on 2 cores
    assert abs(float(loss) - ref_loss) <= 1e-5, (float(loss), ref_loss)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, atol=1e-5, rtol=0), new, ref_params)
    # the new parameters and Adam's moments stayed in their layouts
    jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(f"{x.sharding} != {s}"), new, p_sh)
    mu = opt_state[0].mu
    assert mu["gptj/blocks/attn"]["q"].sharding.is_equivalent_to(p_sh["gptj/blocks/attn"]["q"], 3)


def mesh_of(shape):
    return make_mesh(*shape, devices=jax.devices()[:math.prod(shape)], config=CFG)


def expected_shard_shapes(dp, fsdp, mp):
    L, D, H, F, V = CFG.n_layer, CFG.d_model, CFG.n_head * CFG.d_head, CFG.d_ff, CFG.n_vocab
    return {
        "gptj/wte/embedding": (V // mp, D // fsdp),
        **{f"gptj/blocks/attn/{t}": (L, H // mp, D // fsdp) for t in "qkv"},
        "gptj/blocks/attn/out": (L, D // fsdp, H // mp),
        "gptj/blocks/mlp/fc_in/w": (L, F // mp, D // fsdp),
        "gptj/blocks/mlp/fc_in/b": (L, F // mp),
        "gptj/blocks/mlp/fc_out/w": (L, D // fsdp, F // mp),
        "gptj/blocks/mlp/fc_out/b": (L, D),
        "gptj/blocks/ln_1/scale": (L, D), "gptj/blocks/ln_1/offset": (L, D),
        "gptj/ln_f/scale": (D,), "gptj/ln_f/offset": (D,),
        "gptj/lm_head/w": (V // mp, D // fsdp),
        "gptj/lm_head/b": (V // mp,),
    }


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "dp%d-fsdp%d-mp%d" % s)
def test_each_device_holds_exactly_its_share(shape):
    mesh = mesh_of(shape)
    params = init_params(CFG, 0, param_shardings(CFG, mesh))
    want = expected_shard_shapes(*shape)
    got = {f"{m}/{p}": x for m, ps in params.items() for p, x in ps.items()}
    assert set(got) == set(want)
    for name, x in got.items():
        shapes = {s.data.shape for s in x.addressable_shards}
        assert shapes == {want[name]}, (name, shapes, want[name])
        assert len(x.addressable_shards) == math.prod(shape)
    dp, fsdp, mp = shape
    q = got["gptj/blocks/attn/q"]
    assert q.addressable_shards[0].data.size * fsdp * mp == q.size   # TP+FSDP weights: 1/(fsdp·mp)


def test_impossible_meshes_say_what_works():
    with pytest.raises(ValueError, match="multiply to 3, which does not divide 8"):
        make_mesh(dp=3)
    with pytest.raises(ValueError, match=r"1×1×1 = 1, but there are 8 devices; .* devices=jax.devices\(\)\[:1\]"):
        make_mesh(1, 1, 1)
    cfg = ModelConfig(n_layer=1, d_model=96, n_head=6, rotary_dim=4, n_vocab=512)
    with pytest.raises(ValueError, match=r"mp=8 must divide n_head=6 and d_ff=384; with 8 devices mp can be \[1, 2\]"):
        make_mesh(mp=8, config=cfg)
    with pytest.raises(ValueError, match=r"fsdp=8 must divide d_model=36"):
        make_mesh(fsdp=8, config=ModelConfig(n_layer=1, d_model=36, n_head=6, rotary_dim=2, n_vocab=64))
    assert dict(make_mesh(config=cfg).shape) == {"dp": 4, "fsdp": 1, "mp": 2}   # inference: mp as far as heads allow
    with pytest.raises(ValueError, match="names a device more than once"):
        make_mesh(dp=2, devices=[jax.devices()[0]] * 2)


def test_plan_of_logits_counts_a_batch_that_does_not_split_whole():
    """`lm.logits` (and a step) leave a batch that does not split over dp × fsdp replicated: every device holds all of
    its rows, as XLA's program does; only generation pads the batch to the mesh, one row per device here."""
    from meshtx.compiled import compiled_memory
    cfg = CFG.replace(param_dtype="float32", compute_dtype="float32")
    mesh = make_mesh(dp=8)
    whole, split = (plan(cfg, mesh, mode="infer", batch=b, seq=64, param_dtype="float32", compute_dtype="float32") for b in (4, 8))
    assert whole.bytes["activations"] > 3 * split.bytes["activations"] and any("does not split" in n for n in whole.notes)
    xla = compiled_memory(cfg, mesh, mode="infer", batch=4, seq=64, param_dtype="float32", compute_dtype="float32")
    assert whole.total >= 0.9 * xla.total, (whole.total, xla.total)   # it counted 0.54 of XLA's when it padded
    generating = plan(cfg, mesh, mode="infer", batch=4, seq=64, prompt=32, param_dtype="float32", compute_dtype="float32")
    assert generating.bytes["activations"] < whole.bytes["activations"]
    assert dict(make_mesh(dp=2, mode="train").shape) == {"dp": 2, "fsdp": 4, "mp": 1}   # training: what dp leaves, fsdp takes


def test_lm_on_mesh_and_reshard(hf_checkpoint):
    from conftest import hf_logits
    path, model = hf_checkpoint(CFG)
    tokens = np.random.default_rng(1).integers(0, CFG.n_vocab, (4, 9))
    lm = LM.from_hf(path, dtype="float32", mesh=make_mesh(mp=8), progress=False)
    assert {s.data.shape for s in lm.params["gptj/blocks/mlp/fc_in"]["w"].addressable_shards} == {(2, 32, 64)}   # [L, F/mp, D]
    np.testing.assert_allclose(np.asarray(lm.logits(tokens)), hf_logits(model, tokens), atol=1e-4, rtol=0)
    lm.shard(make_mesh(dp=2, fsdp=2, mp=2))
    assert {s.data.shape for s in lm.params["gptj/blocks/mlp/fc_in"]["w"].addressable_shards} == {(2, 128, 32)}   # [L, F/mp, D/fsdp]
    np.testing.assert_allclose(np.asarray(lm.logits(tokens)), hf_logits(model, tokens), atol=1e-4, rtol=0)


LOAD_ON_MESH = textwrap.dedent("""
    import sys, resource, json, psutil, jax
    jax.config.update("jax_num_cpu_devices", 8)
    from meshtx import LM
    from meshtx.sharding import make_mesh
    mesh = make_mesh(mp=8)
    jax.numpy.zeros(1).block_until_ready()
    base = psutil.Process().memory_info().rss
    lm = LM.from_hf(sys.argv[1], dtype="float32", mesh=mesh, tokenizer=None, progress=False)  # weights only
    jax.block_until_ready(lm.params)
    # VmHWM: this process image's peak RSS (ru_maxrss would include the parent's, inherited across fork+exec)
    peak = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
    shards = {f"{m}/{p}": sorted({s.data.shape for s in x.addressable_shards}) for m, ps in lm.params.items() for p, x in ps.items()}
    print(json.dumps({"growth": peak - base, "fp32": lm.config.n_params * 4, "shards": shards}))
""")

MAKE_CKPT = textwrap.dedent("""
    import sys, torch, transformers
    from meshtx import ModelConfig
    cfg = ModelConfig(n_layer=4, d_model=1024, n_head=16, rotary_dim=32, n_vocab=50400, n_ctx=256)
    torch.manual_seed(0)
    transformers.GPTJForCausalLM(cfg.to_hf()).save_pretrained(sys.argv[1])
""")


@pytest.mark.slow
def test_loading_on_a_mesh_never_replicates(tmp_path):
    "Loading with mesh= places each tensor into its shards: no full copy per device, peak host memory ~1x."
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, "-c", MAKE_CKPT, str(ckpt)], check=True, capture_output=True, timeout=600, env=env)
    size = (ckpt / "model.safetensors").stat().st_size
    assert size >= 200e6, size
    r = subprocess.run([sys.executable, "-c", LOAD_ON_MESH, str(ckpt)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["shards"]["gptj/blocks/attn/q"] == [[4, 128, 1024]]
    assert m["shards"]["gptj/wte/embedding"] == [[6300, 1024]]
    ratio = m["growth"] / m["fp32"]
    print(f"checkpoint {size / 1e6:.0f} MB fp32; peak RSS growth while loading onto 8 devices: {ratio:.2f}x")
    assert ratio < 1.5, ratio   # a replicated copy per device would be 8x


def test_plan_gptj_6b_analytic():
    p = plan("gptj-6b", 1, mode="infer", batch=1, seq=2048, backend="tpu")
    assert p.bytes["params"] == 6_050_882_784 * 2            # 12.1 GB of bf16 weights
    assert round(p.bytes["params"] / 1e9, 1) == 12.1
    assert p.kv_cache_per_token == 458_752                    # 28 layers x (k, v) x 4096 x 2 bytes
    assert p.bytes["kv_cache"] == 458_752 * 2048
    cpu = plan("gptj-6b", 1, mode="infer", batch=1, seq=2048, backend="cpu")   # meshtx keeps a float32 cache there
    assert (cpu.kv_cache_per_token, cpu.bytes["kv_cache"]) == (2 * 458_752, 2 * 458_752 * 2048)
    tp8 = plan("gptj-6b", 8, mode="infer", backend="tpu")
    assert tp8.mesh == {"dp": 1, "fsdp": 1, "mp": 8}
    assert tp8.bytes["kv_cache"] == 458_752 * 2048 // 8
    assert abs(tp8.bytes["params"] - p.bytes["params"] / 8) < 0.002 * p.bytes["params"]   # all but LayerNorms split


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 2, 2), (1, 8, 1)], ids=lambda s: "dp%d-fsdp%d-mp%d" % s)
def test_plan_matches_real_arrays(shape):
    mesh = mesh_of(shape)
    dev = jax.devices()[0]
    def on_device0(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)
    p_sh = param_shardings(CFG, mesh)
    params = init_params(CFG, 0, p_sh)
    train = plan(CFG, mesh, mode="train", batch=8, seq=16, param_dtype="float32")
    opt_state = jax.jit(OPT.init, out_shardings=opt_state_shardings(OPT, params, p_sh, mesh))(params)
    tokens = jax.device_put(np.zeros((8, 17), np.int32), batch_sharding(mesh, (8, 17)))
    model = gptj(CFG, activation_hint(mesh))
    grads = jax.jit(jax.grad(lambda p, t: cross_entropy(model.apply(p, t[:, :-1]), t[:, 1:])), out_shardings=p_sh)(params, tokens)
    for name, real in (("params", params), ("opt_state", opt_state), ("grads", grads)):
        got, want = on_device0(real), train.bytes[name]
        assert abs(got - want) <= 0.05 * want, (name, got, want)
    infer = plan(CFG, mesh, mode="infer", batch=8, seq=32, compute_dtype="bfloat16")
    cache = jax.device_put(KVCache.init(CFG.replace(compute_dtype="bfloat16"), 8, 32), kv_cache_shardings(mesh, 8, CFG))
    got = on_device0((cache.k, cache.v))
    assert abs(got - infer.bytes["kv_cache"]) <= 0.05 * infer.bytes["kv_cache"], (got, infer.bytes["kv_cache"])


def test_plan_full_training_matches_xla():
    "The full step's memory as XLA's buffer assignment counts it: gradients, and the update after them."
    from meshtx.train import make_optimizer, make_train_step, TrainState
    from meshtx.model import param_shapes
    cfg = ModelConfig(n_layer=2, d_model=512, n_head=8, rotary_dim=16, n_vocab=4096, n_ctx=64,
                      param_dtype="float32", compute_dtype="float32", remat=True)
    params = param_shapes(cfg)
    opt = make_optimizer()
    state = TrainState(params, jax.eval_shape(opt.init, params), jax.ShapeDtypeStruct((), np.int32))
    tokens = jax.ShapeDtypeStruct((1, 1, 33), np.int32)
    m = make_train_step(cfg, opt).lower(state, tokens).compile().memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    p = plan(cfg, 1, mode="train", batch=1, seq=32, compute_dtype="float32")
    assert p.remat and p.bytes["updates"] == p.bytes["params"] > p.bytes["activations"]
    assert abs(p.total - xla) <= 0.05 * xla, (p.total, xla, p.bytes)   # without the update: 15 % short


def test_plan_cli():
    exe = os.path.join(os.path.dirname(sys.executable), "meshtx")
    r = subprocess.run([exe, "plan", "--preset", "gptj-6b", "--devices", "8", "--mode", "train"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "mesh dp=1 fsdp=8 mp=1 (8 devices)" in r.stdout and "opt_state" in r.stdout and "fits:" in r.stdout
    # 6 devices: fsdp as large as divides d_model=4096 (2), the rest data-parallel
    r = subprocess.run([exe, "plan", "--mode", "train", "--devices", "6"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "mesh dp=3 fsdp=2 mp=1 (6 devices)" in r.stdout
    # generation's plan: 16 prompts of 128 tokens into 384 slots on one 16 GB chip (measured there: it does not fit)
    r = subprocess.run([exe, "plan", "--batch", "16", "--seq", "384", "--prompt", "128", "--device", "tpu-v5e"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "batch=16, seq=384, prompt=128" in r.stdout and "fits: tpu-v5e no" in r.stdout
    r = subprocess.run([exe, "plan", "--mode", "lora", "--prompt", "128"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "only with mode='infer'" in r.stderr


@pytest.mark.skipif(jax.__version_info__ < (0, 10), reason="the prefill under jax 0.7.2's XLA (the compat run) holds more: "
                    "1.2-1.9x this plan, measured; the plan counts today's XLA")
@pytest.mark.parametrize("dtype,batch,prompt,slots", [("float32", 1, 128, 512), ("float32", 8, 64, 512), ("float32", 16, 128, 384),
                                                      ("bfloat16", 8, 64, 512)])
def test_plan_of_generation_matches_xla(dtype, batch, prompt, slots):
    """`plan(prompt=...)` against XLA's buffer assignment of `generate`'s prefill (the prompt into a cache of `slots`,
    the last position's logits), compiled from abstract shapes, the blocks' weights one layer at a time as on a CPU.
    Without `prompt` the plan counts a forward of every slot, with every position's logits: 1.5-4x too much here."""
    from functools import partial
    from meshtx import sampling
    from meshtx.model import param_shapes, split_layers
    cfg = ModelConfig(n_layer=4, d_model=512, n_head=8, d_head=64, rotary_dim=32, n_vocab=8192, n_ctx=1024,
                      param_dtype=dtype, compute_dtype=dtype)
    model = gptj(cfg)
    params, layers = split_layers(param_shapes(cfg), lambda x, i: jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
    cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, slots))
    prefill = jax.jit(lambda p, l, t, m, c: sampling._prefill(partial(model.apply, layers=l), p, t, m, c, cfg.n_vocab), donate_argnums=4)
    ids = jax.ShapeDtypeStruct((batch, prompt), np.int32)
    m = prefill.lower(params, layers, ids, ids, cache).compile().memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    p = plan(cfg, 1, mode="infer", batch=batch, seq=slots, prompt=prompt, param_dtype=dtype, compute_dtype=dtype, backend="cpu")
    assert 0.9 * xla <= p.total <= 1.15 * xla, (p.total, xla, p.bytes)
    assert plan(cfg, 1, mode="infer", batch=batch, seq=slots, param_dtype=dtype, compute_dtype=dtype, backend="cpu").total > 1.3 * xla


@pytest.mark.parametrize("family", ["gptj", "llama"])
def test_plan_of_a_bf16_full_step_on_cpu_matches_xla(family):
    """A full step with bfloat16 weights and moments on a CPU: XLA:CPU computes the optimizer's update in float32, a
    buffer twice the weights' bf16 size, and the plan counts it so (it said 0.80x of XLA's figure before). Elsewhere
    the update stays in the weights' dtype, as measured on a TPU v5e (bench/RESULTS.md)."""
    import jax.numpy as jnp
    from meshtx.train import make_optimizer, make_train_step, TrainState
    cfg = ModelConfig(family=family, n_layer=2, d_model=1024, n_head=8, d_head=128, rotary_dim=32 if family == "gptj" else None,
                      n_kv_head=2 if family == "llama" else None, n_vocab=4096, n_ctx=128,
                      param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
    shapes = jax.eval_shape(gptj(cfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    opt = make_optimizer()   # the moments in the weights' dtype
    state = TrainState(shapes, jax.eval_shape(opt.init, shapes), jax.ShapeDtypeStruct((), jnp.int32))
    m = make_train_step(cfg, opt).lower(state, jax.ShapeDtypeStruct((1, 1, 65), np.int32)).compile().memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    kw = dict(mode="train", batch=1, seq=64, param_dtype="bfloat16", opt_dtype="bfloat16", remat=True)
    p = plan(cfg, 1, backend="cpu", **kw)
    assert 0.9 * xla <= p.total <= 1.1 * xla, (p.total, xla, p.bytes)
    from meshtx.sharding import _cpu_widened   # one layer's float32 copies beside the update where jaxlib 0.7 widens (else 0)
    widened = _cpu_widened(cfg, param_shapes(cfg), 1, "cpu", "bfloat16", [])
    assert p.bytes["updates"] == 2 * p.bytes["params"] + widened and any("float32" in n for n in p.notes)
    tpu = plan(cfg, 1, backend="tpu", **kw)
    assert tpu.bytes["updates"] == 0 and any("fused" in n for n in tpu.notes) and tpu.total < p.total   # measured there


# XLA's compiled memory analysis of one training step on a TPU v5e chip (GiB; bench/tpu.py plan, twenty-second session,
# bench/RESULTS.md): bf16 weights, remat, LoRA rank 8 with float32 AdamW, or a full step with bf16 Adam moments
TPU_V5E_STEPS = [("qwen2.5-0.5b", "lora", 1, 2048, 1.453), ("qwen2.5-0.5b", "train", 1, 2048, 4.877),
                 ("llama-3.2-1b", "lora", 1, 2048, 3.373), ("llama-3.2-1b", "train", 1, 2048, 11.443),
                 ("pythia-1.4b", "lora", 1, 2048, 3.429), ("pythia-1.4b", "train", 1, 2048, 11.242),
                 ("qwen2.5-1.5b", "lora", 1, 2048, 3.749), ("qwen2.5-1.5b", "train", 1, 2048, 13.601),
                 ("llama-3.2-3b", "lora", 1, 2048, 7.499), ("gptj-6b", "lora", 1, 2048, 13.156),
                 ("qwen2.5-0.5b", "lora", 4, 512, 1.455), ("qwen2.5-0.5b", "train", 4, 512, 4.878),
                 ("llama-3.2-1b", "lora", 4, 512, 3.013), ("llama-3.2-1b", "train", 4, 512, 11.457),
                 ("pythia-1.4b", "lora", 4, 512, 3.312), ("pythia-1.4b", "train", 4, 512, 10.988),
                 ("qwen2.5-1.5b", "lora", 4, 512, 3.659), ("qwen2.5-1.5b", "train", 4, 512, 13.603),
                 ("llama-3.2-3b", "lora", 4, 512, 7.348), ("gptj-6b", "lora", 4, 512, 13.117)]


# Full steps (bf16 Adam moments, or float32 weights and moments) at more shapes and meshes (twenty-third and -fourth
# sessions): one chip, and Kaggle's v5e-8 compiled for its topology without the chips (jax.experimental.topologies).
# (preset, layers (None: the preset's), weights' dtype, batch, seq, dp, fsdp, mp, XLA GiB per chip)
TPU_V5E_FULL_STEPS = [
    ("llama-3.2-1b", None, "bfloat16", 1, 256, 1, 1, 1, 9.370), ("pythia-1.4b", None, "bfloat16", 1, 256, 1, 1, 1, 10.882),
    ("qwen2.5-0.5b", None, "bfloat16", 1, 256, 1, 1, 1, 3.925), ("llama-3.2-1b", None, "bfloat16", 1, 1024, 1, 1, 1, 11.312),
    ("pythia-1.4b", None, "bfloat16", 1, 1024, 1, 1, 1, 10.953), ("qwen2.5-0.5b", None, "bfloat16", 1, 1024, 1, 1, 1, 4.799),
    ("llama-3.2-1b", None, "bfloat16", 1, 4096, 1, 1, 1, 14.016), ("qwen2.5-0.5b", None, "bfloat16", 1, 4096, 1, 1, 1, 5.810),
    ("llama-3.2-1b", None, "bfloat16", 8, 512, 1, 1, 1, 11.707), ("pythia-1.4b", None, "bfloat16", 8, 512, 1, 1, 1, 11.736),
    ("qwen2.5-0.5b", None, "bfloat16", 8, 512, 1, 1, 1, 5.042), ("llama-3.2-1b", None, "bfloat16", 4, 2048, 1, 1, 1, 15.030),
    ("pythia-1.4b", None, "bfloat16", 4, 2048, 1, 1, 1, 14.436), ("qwen2.5-0.5b", None, "bfloat16", 4, 2048, 1, 1, 1, 6.351),
    ("qwen2.5-0.5b", None, "bfloat16", 2, 256, 1, 1, 1, 3.825), ("qwen2.5-0.5b", None, "bfloat16", 2, 1024, 1, 1, 1, 4.880),
    ("llama-3.2-1b", None, "bfloat16", 1, 512, 1, 1, 1, 9.527), ("llama-3.2-1b", None, "bfloat16", 2, 1024, 1, 1, 1, 11.455),
    ("pythia-1.4b", None, "bfloat16", 2, 256, 1, 1, 1, 11.029), ("pythia-1.4b", None, "bfloat16", 2, 1024, 1, 1, 1, 11.082),
    ("qwen2.5-1.5b", None, "bfloat16", 1, 512, 1, 1, 1, 11.884), ("qwen2.5-1.5b", None, "bfloat16", 2, 1024, 1, 1, 1, 13.601),
    ("gptj-6b", 4, "bfloat16", 1, 256, 1, 1, 1, 9.537), ("gptj-6b", 4, "bfloat16", 1, 2048, 1, 1, 1, 10.185),
    ("qwen2.5-0.5b", None, "float32", 1, 256, 1, 1, 1, 8.886), ("qwen2.5-0.5b", None, "float32", 1, 2048, 1, 1, 1, 9.064),
    ("llama-3.2-1b", 8, "float32", 1, 256, 1, 1, 1, 13.546), ("llama-3.2-1b", 8, "float32", 1, 2048, 1, 1, 1, 14.409),
    ("pythia-1.4b", 8, "float32", 1, 256, 1, 1, 1, 9.894), ("pythia-1.4b", 8, "float32", 1, 2048, 1, 1, 1, 10.084),
    ("gptj-6b", 1, "float32", 1, 256, 1, 1, 1, 10.079), ("gptj-6b", 1, "float32", 1, 2048, 1, 1, 1, 10.695),
    ("qwen2.5-1.5b", 10, "float32", 1, 256, 1, 1, 1, 12.815), ("qwen2.5-1.5b", 10, "float32", 1, 2048, 1, 1, 1, 12.951),
    ("gptj-6b", None, "bfloat16", 8, 2048, 1, 8, 1, 8.137), ("gptj-6b", None, "float32", 8, 2048, 1, 8, 1, 15.026),
    ("gptj-6b", None, "bfloat16", 8, 512, 1, 8, 1, 7.714), ("gptj-6b", None, "bfloat16", 8, 1024, 1, 8, 1, 7.754),
    ("gptj-6b", None, "float32", 8, 512, 1, 8, 1, 14.023), ("gptj-6b", None, "bfloat16", 8, 2048, 1, 4, 2, 9.043),
    ("gptj-6b", None, "bfloat16", 8, 512, 1, 4, 2, 6.972), ("gptj-6b", None, "bfloat16", 8, 2048, 1, 2, 4, 9.758),
    ("gptj-6b", None, "bfloat16", 8, 2048, 1, 1, 8, 13.526), ("llama-3.2-1b", None, "bfloat16", 8, 2048, 1, 8, 1, 3.245),
    ("llama-3.2-1b", None, "float32", 8, 2048, 1, 8, 1, 4.396), ("llama-3.2-1b", None, "float32", 8, 256, 1, 8, 1, 3.707),
    ("llama-3.2-1b", None, "bfloat16", 8, 256, 1, 8, 1, 2.494), ("llama-3.2-1b", None, "bfloat16", 8, 2048, 8, 1, 1, 10.954),
    ("llama-3.2-1b", None, "bfloat16", 8, 2048, 1, 4, 2, 2.549), ("llama-3.2-1b", None, "bfloat16", 8, 512, 1, 4, 2, 2.116),
    ("llama-3.2-1b", None, "bfloat16", 8, 2048, 1, 1, 8, 4.064), ("qwen2.5-0.5b", None, "bfloat16", 8, 256, 1, 8, 1, 1.283),
    ("pythia-1.4b", None, "bfloat16", 8, 256, 1, 8, 1, 1.968), ("pythia-1.4b", None, "bfloat16", 8, 2048, 1, 4, 2, 2.643),
    ("qwen2.5-0.5b", None, "bfloat16", 1, 512, 1, 1, 1, 3.798), ("llama-3.2-1b", None, "bfloat16", 2, 256, 1, 1, 1, 9.528),
    ("pythia-1.4b", None, "bfloat16", 1, 512, 1, 1, 1, 11.028), ("qwen2.5-1.5b", None, "bfloat16", 2, 256, 1, 1, 1, 11.887),
    ("qwen2.5-0.5b", None, "float32", 2, 1024, 1, 1, 1, 8.891),
    # measured after the rules were chosen (bench/tpu.sh PART=6)
    ("llama-3.2-3b", 12, "bfloat16", 1, 1024, 1, 1, 1, 15.028), ("mistral-7b", 4, "bfloat16", 1, 512, 1, 1, 1, 9.164),
    ("qwen2.5-7b", 3, "bfloat16", 2, 1024, 1, 1, 1, 16.482), ("qwen2.5-1.5b", None, "bfloat16", 8, 2048, 1, 4, 2, 2.814),
    ("llama-3.2-3b", None, "bfloat16", 8, 2048, 1, 4, 2, 5.335), ("llama-3.2-3b", None, "bfloat16", 8, 1024, 1, 8, 1, 5.608),
    ("gptj-6b", None, "bfloat16", 16, 2048, 1, 8, 1, 10.318), ("mistral-7b", None, "bfloat16", 8, 2048, 1, 8, 1, 10.490),
    ("pythia-6.9b", None, "bfloat16", 8, 1024, 1, 2, 4, 9.123), ("llama-3.1-8b", None, "bfloat16", 8, 512, 1, 8, 1, 11.498),
    ("qwen2.5-7b", None, "bfloat16", 8, 256, 1, 8, 1, 11.455), ("llama-3.2-3b", None, "bfloat16", 8, 4096, 1, 2, 4, 11.810)]


def test_plan_of_training_steps_on_a_tpu_matches_the_chips_xla():
    """On the chip, XLA computes the loss one chunk of logits at a time and frees it before the blocks' backward, so
    where the vocabulary is large beside the model (Qwen2.5-0.5B: 151,936 × 896) counting the CPU's buffers over-counted
    a LoRA step by 42 %. It also fuses the update of bf16 weights into their write (a full step at one loss chunk holds
    the gradients and little more: counting an update over-counted it by 17-23 %), and under tensor parallelism the
    blocks' backward holds many replicated [tokens, d_model] buffers (counted as the residuals again: without them GPT-J-6B
    with mp=8 was 0.75 of XLA's figure), and under FSDP a block's float32 gradient before its reduce-scatter. The plan
    for a TPU stays within 10 % of the chip's own analysis at 82 of these 91 points, one chip or eight (10 of the 12
    measured after the rules were chosen), and is never under by more than the 8 % `fits` keeps free; the others
    over-count (the safe side)."""
    ratios = {}
    for name, mode, batch, seq, xla_gib in TPU_V5E_STEPS:
        cfg = ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
        kw = dict(lora_rank=8) if mode == "lora" else dict(opt_dtype="bfloat16")
        p = plan(cfg, 1, mode=mode, batch=batch, seq=seq, device="tpu-v5e", param_dtype="bfloat16", remat=True, **kw)
        ratios[name, mode, None, "bfloat16", batch, seq, 1, 1, 1] = p.total / 2**30 / xla_gib
        if mode == "lora": assert any("a chunk at a time" in n for n in p.notes)
    for name, layers, dtype, batch, seq, dp, fsdp, mp, xla_gib in TPU_V5E_FULL_STEPS:
        cfg = ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
        cfg = cfg.replace(n_layer=layers) if layers else cfg
        p = plan(cfg, dp * fsdp * mp, mode="train", batch=batch, seq=seq, device="tpu-v5e", param_dtype=dtype,
                 opt_dtype=dtype, remat=True, dp=dp, fsdp=fsdp, mp=mp)
        ratios[name, "train", layers, dtype, batch, seq, dp, fsdp, mp] = p.total / 2**30 / xla_gib
        assert (p.bytes["updates"] == 0) == (dtype == "bfloat16"), p.bytes
    assert len(ratios) == 91 and all(0.92 <= r <= 1.3 for r in ratios.values()), ratios
    outside = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > 0.1}
    assert len(outside) <= 9 and all(r > 1 for r in outside.values()), outside

# LoRA steps (rank 8, bf16 base, float32 adapters replicated) on Kaggle's v5e-8, compiled for its topology from one chip
# (twenty-fifth session, `bench/tpu_steps.py aot` with a rank): (preset, batch, seq, dp, fsdp, mp, XLA GiB per chip)
TPU_V5E_LORA_MESH_STEPS = [
    ("gptj-6b", 8, 2048, 1, 8, 1, 3.587), ("gptj-6b", 8, 2048, 1, 4, 2, 4.149), ("gptj-6b", 8, 2048, 1, 2, 4, 5.323),
    ("gptj-6b", 8, 2048, 1, 1, 8, 8.733), ("gptj-6b", 8, 2048, 8, 1, 1, 13.172), ("gptj-6b", 16, 2048, 1, 4, 2, 6.306),
    ("llama-3.2-1b", 8, 2048, 1, 8, 1, 1.561), ("llama-3.2-1b", 8, 2048, 1, 4, 2, 1.590), ("llama-3.2-1b", 8, 2048, 1, 1, 8, 3.571),
    ("llama-3.2-1b", 8, 2048, 8, 1, 1, 3.381), ("qwen2.5-0.5b", 8, 2048, 1, 4, 2, 0.813), ("llama-3.1-8b", 8, 2048, 1, 8, 1, 4.456),
    ("llama-3.1-8b", 8, 2048, 1, 4, 2, 5.548), ("llama-3.1-8b", 8, 2048, 1, 1, 8, 10.120), ("mistral-7b", 8, 2048, 1, 8, 1, 4.488),
    ("mistral-7b", 8, 2048, 1, 1, 8, 9.935), ("qwen2.5-7b", 8, 2048, 1, 8, 1, 4.424), ("qwen2.5-7b", 8, 2048, 1, 2, 4, 6.310),
    ("pythia-6.9b", 8, 2048, 1, 2, 4, 6.031), ("llama-3.2-3b", 8, 4096, 1, 4, 2, 5.602)]


def test_plan_of_lora_steps_on_eight_tpu_chips_is_on_the_safe_side():
    """A LoRA step under tensor parallelism was counted like a full step's backward (the replicated [tokens, d_model]
    buffers) before any was measured. Compiled for Kaggle's v5e-8, 20 LoRA steps of six families at every mesh shape
    read 0.948-1.200 of XLA's figure: never under by more than the 8 % that `fits` keeps free, 13 within 10 %, and the
    rest over (the safe side: small models, or mp > 1 where the replicated buffers overlap less than counted)."""
    ratios = {}
    for name, batch, seq, dp, fsdp, mp, xla_gib in TPU_V5E_LORA_MESH_STEPS:
        cfg = ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
        p = plan(cfg, 8, mode="lora", batch=batch, seq=seq, device="tpu-v5e", param_dtype="bfloat16", lora_rank=8,
                 remat=True, dp=dp, fsdp=fsdp, mp=mp)
        ratios[name, batch, seq, dp, fsdp, mp] = p.total / 2**30 / xla_gib
        assert p.fits and any(f"on a TPU with mp={mp}" in n for n in p.notes) == (mp > 1), (name, mp, p.notes)
    assert len(ratios) == 20 and all(0.94 <= r <= 1.21 for r in ratios.values()), ratios
    outside = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > 0.1}
    assert len(outside) <= 7 and all(r > 1 for r in outside.values()), outside


# XLA:GPU's memory analysis (GiB per GPU), compiled on a machine without a GPU through JAX's CUDA plugin
# (`bench/gpu_plan.py`, twenty-sixth session; the train steps compiled with `step_options`, as the Trainer compiles them).
# generate's prefill on one GPU, bf16: (chip, preset, batch, prompt, cache slots, GiB)
GPU_PREFILLS = [
    ("h100", "gptj-6b", 1, 128, 2048, 12.790), ("h100", "gptj-6b", 8, 512, 2048, 20.898),
    ("h100", "llama-3.1-8b", 1, 512, 8192, 16.677), ("h100", "llama-3.2-1b", 16, 256, 4096, 4.795),
    ("h100", "qwen2.5-0.5b", 4, 1024, 4096, 1.519), ("h100", "mistral-7b", 2, 2048, 4096, 16.656),
    ("t4", "llama-3.2-1b", 1, 512, 2048, 3.347), ("t4", "qwen2.5-0.5b", 4, 512, 2048, 1.528), ("t4", "gptj-6b", 1, 128, 1024, 12.537),
    # measured after the rules were chosen
    ("h100", "qwen2.5-7b", 4, 512, 4096, 15.508), ("h100", "pythia-1.4b", 8, 1024, 2048, 8.013), ("t4", "llama-3.2-3b", 2, 256, 1024, 7.676)]
# training steps, remat: (chip, mode, preset, weights' and moments' dtype, batch, seq, fsdp, mp, GPUs (dp: the rest), GiB per GPU)
GPU_STEPS = [
    ("h100", "lora", "gptj-6b", "bfloat16", 1, 2048, 1, 1, 1, 12.624), ("h100", "lora", "gptj-6b", "bfloat16", 4, 512, 1, 1, 1, 12.597),
    ("h100", "lora", "llama-3.1-8b", "bfloat16", 1, 2048, 1, 1, 1, 17.000), ("h100", "lora", "llama-3.2-1b", "bfloat16", 4, 2048, 1, 1, 1, 5.849),
    ("h100", "lora", "qwen2.5-0.5b", "bfloat16", 1, 2048, 1, 1, 1, 1.497), ("h100", "train", "gptj-6b", "bfloat16", 1, 2048, 1, 1, 1, 46.476),
    ("h100", "train", "llama-3.2-1b", "bfloat16", 4, 2048, 1, 1, 1, 12.730), ("h100", "train", "qwen2.5-0.5b", "bfloat16", 1, 2048, 1, 1, 1, 4.463),
    ("h100", "train", "pythia-1.4b", "bfloat16", 8, 512, 1, 1, 1, 11.682), ("h100", "train", "llama-3.2-1b", "float32", 1, 2048, 1, 1, 1, 19.741),
    ("h100", "train", "qwen2.5-1.5b", "float32", 2, 1024, 1, 1, 1, 24.057), ("h100", "train", "gptj-6b", "bfloat16", 8, 2048, 8, 1, 8, 8.316),
    ("h100", "train", "gptj-6b", "bfloat16", 8, 2048, 4, 2, 8, 8.091), ("h100", "train", "gptj-6b", "bfloat16", 8, 2048, 1, 8, 8, 11.080),
    ("h100", "train", "llama-3.1-8b", "float32", 8, 2048, 8, 1, 8, 20.952), ("h100", "train", "llama-3.2-1b", "bfloat16", 8, 2048, 4, 2, 8, 2.579),
    ("h100", "lora", "gptj-6b", "bfloat16", 8, 2048, 8, 1, 8, 3.748), ("h100", "lora", "gptj-6b", "bfloat16", 8, 2048, 2, 4, 8, 5.028),
    ("h100", "lora", "llama-3.1-8b", "bfloat16", 8, 2048, 1, 8, 8, 8.415), ("h100", "lora", "llama-3.2-1b", "bfloat16", 8, 2048, 4, 2, 8, 1.712),
    ("t4", "lora", "qwen2.5-0.5b", "bfloat16", 1, 1024, 1, 1, 1, 2.103), ("t4", "lora", "llama-3.2-1b", "bfloat16", 1, 1024, 1, 1, 1, 3.908),
    ("t4", "lora", "qwen2.5-0.5b", "bfloat16", 1, 2048, 1, 1, 1, 2.149), ("t4", "train", "qwen2.5-0.5b", "bfloat16", 1, 512, 1, 1, 1, 4.537),
    ("t4", "lora", "gptj-6b", "bfloat16", 1, 512, 1, 1, 1, 12.530),
    # measured after the rules were chosen
    ("h100", "lora", "qwen2.5-7b", "bfloat16", 1, 4096, 1, 1, 1, 18.259), ("h100", "train", "llama-3.2-3b", "bfloat16", 2, 2048, 1, 1, 1, 26.473),
    ("h100", "train", "mistral-7b", "bfloat16", 8, 1024, 8, 1, 8, 8.817), ("h100", "lora", "pythia-6.9b", "bfloat16", 8, 2048, 2, 4, 8, 5.810),
    ("h100", "train", "gptj-6b", "float32", 8, 512, 8, 1, 8, 13.388), ("h100", "train", "qwen2.5-1.5b", "bfloat16", 8, 2048, 4, 2, 8, 2.654),
    ("h200", "train", "gptj-6b", "bfloat16", 2, 2048, 1, 1, 1, 47.234), ("a100-80gb", "lora", "llama-3.1-8b", "bfloat16", 2, 2048, 1, 1, 1, 18.432),
    ("l4", "lora", "llama-3.2-1b", "bfloat16", 1, 2048, 1, 1, 1, 3.345), ("t4", "lora", "pythia-1.4b", "bfloat16", 1, 2048, 1, 1, 1, 3.684),
    ("t4", "train", "llama-3.2-1b", "bfloat16", 1, 1024, 1, 1, 1, 11.244)]


def test_plan_on_a_gpu_matches_xla_gpu():
    """`plan` for a GPU against XLA:GPU's own buffer assignment. Before any was measured, a GPU's step was planned as a
    CPU's, and XLA:GPU copied the new weights and moments out of the step's `cond` into place (a full step was 1.40x
    the plan). With `step_options` the update is fused into the weights' write, as on a TPU, and the loss, one chunk in
    flight, is the TPU's too; under mp the blocks' backward holds a quarter of the residuals again (a TPU: all of them).
    A T4 (no bf16 arithmetic) computes bf16 in float32, with float32 copies of the head. 48 points, six families, five
    chips, one GPU or eight: 0.93-1.20 of XLA's figure, 42 within 10 % (13 of the 14 measured after the rules were
    chosen), none under by more than the 8 % `fits` keeps free; the rest over (small models: the safe side)."""
    ratios = {}
    for chip, name, batch, prompt, slots, xla_gib in GPU_PREFILLS:
        cfg = ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16")
        p = plan(cfg, 1, mode="infer", batch=batch, seq=slots, prompt=prompt, device=chip, param_dtype="bfloat16")
        ratios["infer", chip, name, batch, prompt, slots] = p.total / 2**30 / xla_gib
    for chip, mode, name, dtype, batch, seq, fsdp, mp, n, xla_gib in GPU_STEPS:
        cfg = ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
        kw = dict(lora_rank=8) if mode == "lora" else dict(opt_dtype=dtype)
        p = plan(cfg, n, mode=mode, batch=batch, seq=seq, device=chip, param_dtype=dtype, remat=True,
                 dp=n // (fsdp * mp), fsdp=fsdp, mp=mp, **kw)
        ratios[mode, chip, name, dtype, batch, seq, fsdp, mp, n] = p.total / 2**30 / xla_gib
        if mode == "train": assert p.bytes["updates"] == 0 and any("fused" in note for note in p.notes), p.notes
        assert any(f"on a GPU with mp={mp}" in note and "0.25 of the saved" in note for note in p.notes) == (mp > 1), p.notes
    assert len(ratios) == 48 and all(0.92 <= r <= 1.21 for r in ratios.values()), ratios
    outside = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > 0.1}
    assert len(outside) <= 6 and all(r > 1 for r in outside.values()), outside


# Steps on Kaggle's v5e-8 compiled on a CPU machine through libtpu (`bench/tpu_plan.sh`: `compiled_memory` with a
# topology's devices; twenty-seventh session): (preset, mode, weights' and moments' dtype, batch, seq, dp, fsdp, mp, GiB per chip)
TPU_V5E8_COMPILED_HERE = [
    ("qwen2.5-0.5b", "train", "float32", 8, 1024, 1, 8, 1, 2.091), ("qwen2.5-0.5b", "train", "float32", 8, 2048, 1, 8, 1, 2.185),
    ("qwen2.5-0.5b", "train", "float32", 8, 256, 1, 8, 1, 1.716), ("pythia-1.4b", "train", "float32", 8, 1024, 1, 8, 1, 3.258),
    ("llama-3.2-1b", "train", "float32", 8, 1024, 1, 8, 1, 4.251), ("qwen2.5-1.5b", "train", "float32", 8, 1024, 1, 8, 1, 4.658),
    ("qwen2.5-0.5b", "train", "bfloat16", 8, 1024, 1, 8, 1, 1.626), ("qwen2.5-0.5b", "train", "float32", 8, 1024, 1, 4, 2, 1.659),
    # measured after the rule for the gathered head was chosen
    ("qwen2.5-1.5b", "train", "bfloat16", 8, 1024, 1, 8, 1, 3.082), ("pythia-1.4b", "train", "bfloat16", 8, 2048, 1, 8, 1, 2.138),
    ("llama-3.2-1b", "train", "bfloat16", 8, 1024, 1, 8, 1, 3.097), ("qwen2.5-0.5b", "train", "bfloat16", 8, 2048, 2, 4, 1, 2.187),
    ("llama-3.2-3b", "train", "bfloat16", 8, 2048, 1, 8, 1, 5.967), ("qwen2.5-7b", "train", "bfloat16", 8, 1024, 1, 8, 1, 11.416),
    ("qwen2.5-0.5b", "lora", "bfloat16", 8, 1024, 1, 8, 1, 0.816), ("llama-3.2-1b", "lora", "bfloat16", 8, 2048, 1, 8, 1, 1.561)]


def test_plan_under_fsdp_counts_the_head_gathered_in_the_loss():
    """Under FSDP the loss's loop (more than one chunk of logits) all-gathers the whole head: without it, the plan of
    Qwen2.5-0.5B's step at 8 × 1024 (vocabulary 151,936 × 896) was 0.87 of XLA's figure, under the 8 % that `fits` keeps
    free. With it, 16 steps compiled for a v5e-8 read 0.938-1.295 of XLA's, 14 within 10 % (7 of the 8 measured after
    the rule); the other two over (Pythia-1.4B at fsdp 8: 1.12 and 1.30)."""
    ratios = {}
    for name, mode, dtype, batch, seq, dp, fsdp, mp, xla_gib in TPU_V5E8_COMPILED_HERE:
        cfg = ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
        kw = dict(lora_rank=8) if mode == "lora" else dict(opt_dtype=dtype)
        p = plan(cfg, 8, mode=mode, batch=batch, seq=seq, device="tpu-v5e", param_dtype=dtype, remat=True, dp=dp, fsdp=fsdp, mp=mp, **kw)
        ratios[name, mode, dtype, batch, seq, dp, fsdp, mp] = p.total / 2**30 / xla_gib
    assert len(ratios) == 16 and all(0.92 <= r <= 1.3 for r in ratios.values()), ratios
    outside = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > 0.1}
    assert len(outside) <= 2 and all(r > 1 for r in outside.values()), outside
    assert ratios["qwen2.5-0.5b", "train", "bfloat16", 8, 1024, 1, 8, 1] > 0.95
