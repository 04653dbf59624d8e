"""`compiled_memory` is XLA's figure for meshtx's own programs: it must equal, byte for byte, what the real objects
(a `Trainer` on a real model, `lm.logits`, `generate`'s prefill) compile, on one device and on every mesh shape, for
GPT-J and a grouped-query family; it refuses what cannot be compiled, naming why; and at GPT-J-6B's own shape it
compiles on this CPU without allocating, the weights read in place (no whole-stack conversions among the temporaries)."""
import os, subprocess, sys
import numpy as np
import pytest
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from meshtx import LM, ModelConfig
from meshtx.compiled import compiled_memory
from meshtx.model import backend, cache_dtype, compiling_for, times_wt
from meshtx.sampling import _compiled
from meshtx.sharding import BATCH, fit_spec, make_mesh
from meshtx.train import Trainer

GPTJ = ModelConfig(n_layer=2, d_model=64, n_head=8, rotary_dim=4, n_vocab=512, n_ctx=64)
LLAMA = ModelConfig.preset("llama-3.2-1b").replace(n_layer=2, d_model=64, n_head=8, n_kv_head=2, d_head=8, d_ff=128,
                                                   n_vocab=512, n_ctx=64)
MESHES = [None, (1, 8, 1), (2, 2, 2), (1, 4, 2)]


def _figures(m):
    return m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes


def _mesh(shape):
    if shape is None: return None
    dp, fsdp, mp = shape
    return make_mesh(dp=dp, fsdp=fsdp, mp=mp, devices=jax.devices()[:dp * fsdp * mp])


@pytest.mark.compat   # also under jax 0.7.2 (Colab's TPU image)
@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("mode", ["train", "lora"])
def test_a_training_step_is_the_trainers(shape, mode):
    cfg, mesh = (LLAMA if mode == "lora" else GPTJ), _mesh(shape)
    dtype = "float32" if mode == "train" else "bfloat16"
    lm = LM.init(cfg, dtype=dtype, compute_dtype="bfloat16", tokenizer=None, mesh=mesh)
    t = Trainer(lm, iter([]), lora=4 if mode == "lora" else None, progress=False, remat=True, param_dtype=None)
    batch = 8
    real = t._step.lower(t.state, t._put(np.zeros((1, batch, 33), np.int32)), t._frozen()).compile().memory_analysis()
    c = compiled_memory(cfg, mesh or 1, mode, batch, 32, param_dtype=dtype, lora_rank=4, remat=True)
    assert (c.arguments, c.outputs, c.aliased, c.temporaries) == _figures(real)
    assert c.plan.mode == mode and c.total == c.arguments + c.outputs - c.aliased + c.temporaries


@pytest.mark.compat   # also under jax 0.7.2 (Colab's TPU image)
@pytest.mark.parametrize("shape", [None, (2, 2, 2), (1, 1, 8)], ids=str)
@pytest.mark.parametrize("cfg", [GPTJ, LLAMA], ids=["gptj", "llama"])
def test_inference_is_lm_logits_and_generates_prefill(shape, cfg):
    mesh = _mesh(shape)
    lm = LM.init(cfg, dtype="bfloat16", tokenizer=None, mesh=mesh)
    params, layers = lm.weights()
    tokens = jnp.zeros((4, 32), jnp.int32)
    if mesh is not None: tokens = jax.device_put(tokens, NamedSharding(mesh, fit_spec(P(BATCH), tokens.shape, mesh)))
    real = lm._forward.lower(params, tokens, None, layers=layers).compile().memory_analysis()
    c = compiled_memory(cfg, mesh or 1, "infer", 4, 32)
    assert (c.arguments, c.outputs, c.aliased, c.temporaries) == _figures(real)
    # generate pads 3 prompts to 4 rows, a lone bf16 row on a CPU to 2, then to a multiple of dp × fsdp
    for batch, rows in ((3, 4), (1, 2)):
        if mesh is not None: rows = -(-rows // (mesh.shape["dp"] * mesh.shape["fsdp"])) * mesh.shape["dp"] * mesh.shape["fsdp"]
        fns, ids = _compiled(lm), jnp.zeros((rows, 8), jnp.int32)
        if mesh is not None: ids = jax.device_put(ids, NamedSharding(mesh, fit_spec(P(BATCH), ids.shape, mesh)))
        real = fns.prefill.lower(params, layers, ids, ids, fns.empty_cache(rows, 64)).compile().memory_analysis()
        c = compiled_memory(cfg, mesh or 1, "infer", batch, 64, prompt=8)
        assert (c.arguments, c.outputs, c.aliased, c.temporaries) == _figures(real), (batch, rows)


@pytest.mark.compat   # also under jax 0.7.2 (Colab's TPU image)
def test_the_kernels_are_traced_for_the_target():
    "Compiling for another backend's devices traces that backend's kernels (a GPU's step compiled on this CPU)."
    x, w = jnp.ones((2, 8), jnp.bfloat16), jnp.ones((4, 8), jnp.bfloat16)
    barrier = lambda: "optimization_barrier" in str(jax.make_jaxpr(lambda x, w: times_wt(x, w))(x, w))   # traced anew
    assert backend() == "cpu" and barrier() and cache_dtype(GPTJ.replace(compute_dtype="bfloat16")) == "float32"
    with compiling_for("gpu"):
        assert backend() == "gpu" and not barrier() and cache_dtype(GPTJ.replace(compute_dtype="bfloat16")) == "bfloat16"
    assert backend() == "cpu" and barrier()


@pytest.mark.compat   # also under jax 0.7.2 (Colab's TPU image)
def test_what_cannot_compile_is_refused_by_name():
    mesh = _mesh((2, 2, 2))
    for call, says in [(lambda: compiled_memory(GPTJ, 16), "needs 16; there are 8"),
                       (lambda: compiled_memory(GPTJ, mesh, devices=jax.devices()), "a mesh and also devices="),
                       (lambda: compiled_memory(GPTJ, 1, devices=[]), "devices=[]"),
                       (lambda: compiled_memory(GPTJ, 1, "serve"), "mode"),
                       (lambda: compiled_memory(GPTJ, 1, seq=65), "n_ctx=64"),
                       (lambda: compiled_memory(GPTJ, 1, "train", prompt=4), "prompt=4"),
                       (lambda: compiled_memory(GPTJ, 1).fits("tpu-v9"), "unknown chip 'tpu-v9'")]:
        with pytest.raises(ValueError) as e: call()
        assert says in str(e.value), (says, str(e.value))


def test_gptj_6b_compiles_without_its_weights():
    """GPT-J-6B's own shape, bf16, on this CPU: the weights are the arguments, and they are read in place. (Not under
    jax 0.7.2: its XLA:CPU cannot multiply bf16 into float32, so `einsum32` widens every weight, and its buffer
    assignment gave every layer's float32 copies their own memory: 21.8 GiB of temporaries, measured.)"""
    c = compiled_memory("gptj-6b", 1, "infer", 1, 128)
    weights = 6_050_882_784 * 2
    assert abs(c.arguments - weights) < 2**20 * 8, c.arguments       # the weights, and 128 token ids
    assert c.temporaries < 0.01 * weights, c.temporaries             # no float32 copy of any stack: 0.2 % measured
    assert 0.95 <= c.plan.total / c.total <= 1.1, (c.plan.total, c.total)
    assert c.fits("h100")


def test_meshtx_plan_compile():
    exe = os.path.join(os.path.dirname(sys.executable), "meshtx")
    r = subprocess.run([exe, "plan", "--preset", "tiny", "--mode", "train", "--devices", "8",
                        "--seq", "64", "--batch", "8", "--compile"], capture_output=True, text=True, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mode=train, mesh dp=1 fsdp=8 mp=1 (8 devices)" in r.stdout                       # the plan, then
    assert "XLA's compiled program: mode=train, mesh dp=1 fsdp=8 mp=1, batch=8, seq=64" in r.stdout and "× XLA's" in r.stdout
