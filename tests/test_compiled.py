"""`compiled_memory` is XLA's figure for meshtx's own programs: it must equal, byte for byte, what the real objects
(a `Trainer` on a real model, `lm.logits`, `generate`'s prefill) compile, on one device and on every mesh shape, for
GPT-J and a grouped-query family; it refuses what cannot be compiled, naming why; and at GPT-J-6B's own shape it
compiles on this CPU without allocating, the weights read in place (no whole-stack conversions among the temporaries)."""
import importlib.util, os, subprocess, sys
import numpy as np
import pytest
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from meshtx import LM, ModelConfig
from meshtx.compiled import compiled_memory
from meshtx.model import backend, cache_dtype, compiling_for, cpu_weights_first, times_wt
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
def test_the_kernels_are_traced_for_the_target(monkeypatch):
    """Compiling for another backend's devices traces that backend's kernels (a GPU's step compiled on this CPU). The
    CPU's weights-first products are asked for here (`MESHTX_CPU_WEIGHTS_FIRST=1`), not timed on this machine."""
    monkeypatch.setenv("MESHTX_CPU_WEIGHTS_FIRST", "1"); cpu_weights_first.cache_clear()
    try: _kernels_for_the_target()
    finally: cpu_weights_first.cache_clear()


def test_the_cpus_product_form_is_timed_once_or_told(monkeypatch):
    """Weights-first or not is timed once per process (then cached), unless `MESHTX_CPU_WEIGHTS_FIRST` says which; a
    multi-process job takes `x @ wᵀ` without timing."""
    monkeypatch.delenv("MESHTX_CPU_WEIGHTS_FIRST", raising=False); cpu_weights_first.cache_clear()
    try:
        timed = cpu_weights_first()
        assert isinstance(timed, bool) and cpu_weights_first() is timed and cpu_weights_first.cache_info().misses == 1
        for told in ("0", "1"):
            monkeypatch.setenv("MESHTX_CPU_WEIGHTS_FIRST", told); cpu_weights_first.cache_clear()
            assert cpu_weights_first() == (told == "1")
        # a multi-process job compiles one program in every process: it does not time (processes could choose apart)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        cpu_weights_first.cache_clear(); assert cpu_weights_first()   # told (1) still counts
        monkeypatch.delenv("MESHTX_CPU_WEIGHTS_FIRST"); cpu_weights_first.cache_clear()
        monkeypatch.setattr(jax, "local_devices", lambda **kw: pytest.fail("timed in a multi-process job"))
        assert cpu_weights_first() is False
    finally: cpu_weights_first.cache_clear()


def _kernels_for_the_target():
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
    jax 0.7.2: its XLA:CPU cannot multiply bf16 into float32, so `einsum32` widens the weights, one layer's at a time,
    and the head: 0.79 GiB of temporaries, measured; `test_working_memory_does_not_grow_with_depth` covers it.)"""
    c = compiled_memory("gptj-6b", 1, "infer", 1, 128)
    weights = 6_050_882_784 * 2
    assert abs(c.arguments - weights) < 2**20 * 8, c.arguments       # the weights, and 128 token ids
    assert c.temporaries < 0.01 * weights, c.temporaries             # no float32 copy of any stack: 0.2 % measured
    assert 0.95 <= c.plan.total / c.total <= 1.1, (c.plan.total, c.total)
    assert c.fits("h100")
    g = compiled_memory("gptj-6b", 1, "infer", 1, 2048, prompt=32)   # generate's prefill: a lone bf16 row runs as two here
    assert 0.97 <= g.plan.total / g.total <= 1.03, (g.plan.total, g.total)   # 1.000 measured (0.88 counting one row)


def test_meshtx_plan_compile():
    exe = os.path.join(os.path.dirname(sys.executable), "meshtx")
    r = subprocess.run([exe, "plan", "--preset", "tiny", "--mode", "train", "--devices", "8",
                        "--seq", "64", "--batch", "8", "--compile"], capture_output=True, text=True, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mode=train, mesh dp=1 fsdp=8 mp=1 (8 devices)" in r.stdout                       # the plan, then
    assert "XLA's compiled program: mode=train, mesh dp=1 fsdp=8 mp=1, batch=8, seq=64" in r.stdout and "× XLA's" in r.stdout


LIBTPU = os.environ.get("MESHTX_LIBTPU", os.path.expanduser("~/.cache/meshtx/libtpu"))


@pytest.mark.parametrize("name, says", [("v5e8", "expected a chip and its shape"), ("v5e:2x4", "pip install 'jax[tpu]'")])
def test_meshtx_plan_topology_refuses_by_name(name, says):
    """Without libtpu (CI has none) a topology is refused with what to install; a name JAX would not parse, always."""
    if says.startswith("pip") and importlib.util.find_spec("libtpu") is not None: pytest.skip("libtpu is installed here")
    exe = os.path.join(os.path.dirname(sys.executable), "meshtx")
    r = subprocess.run([exe, "plan", "--preset", "tiny", "--topology", name], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MESHTX_CACHE_DIR="off"))
    assert r.returncode == 2 and f"meshtx: error: TPU topology {name!r}" in r.stderr and says in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_slice_smaller_than_a_host_is_its_own_host(monkeypatch):
    """libtpu lays topologies out in hosts of 2 × 2 chips unless told otherwise; `v5e:1x1` (one chip, Colab's) gets bounds
    of its own shape. Here libtpu's answer is played by a stand-in that refuses as libtpu 0.0.42.1 does (measured)."""
    from jax.experimental import topologies
    from meshtx import compiled
    calls = []
    def desc(platform, topology_name, chips_per_host_bounds=None):
        calls.append((topology_name, chips_per_host_bounds))
        if chips_per_host_bounds is None and topology_name.endswith("1x1"):
            raise RuntimeError(f'INVALID_ARGUMENT: Topology layout "{topology_name}" is not divisible by the given (or '
                               'default) chips_per_host_bounds "2x2x1"')
        if topology_name.startswith("v9"): raise RuntimeError("INVALID_ARGUMENT: unknown chip v9")
        return type("Topology", (), dict(devices=[topology_name]))
    monkeypatch.setattr(topologies, "get_topology_desc", desc)
    monkeypatch.setattr(compiled.importlib.util, "find_spec", lambda name: object())
    assert compiled.tpu_topology("v5e:2x4") == ["v5e:2x4"] and calls == [("v5e:2x4", None)]
    assert compiled.tpu_topology("v5e:1x1") == ["v5e:1x1"] and calls[-1] == ("v5e:1x1", [1, 1, 1])
    with pytest.raises(ValueError, match="TPU topology 'v9:2x2': INVALID_ARGUMENT: unknown chip v9"):
        compiled.tpu_topology("v9:2x2")


@pytest.mark.skipif(not os.path.isdir(os.path.join(LIBTPU, "libtpu")), reason="needs libtpu (bench/tpu_plan.sh installs it)")
def test_meshtx_plan_compiles_for_one_v5e_chip_that_is_not_here():
    """With libtpu on the path (no TPU), `--topology v5e:1x1` compiles Colab's single chip's program on this CPU."""
    exe = os.path.join(os.path.dirname(sys.executable), "meshtx")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([LIBTPU, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu",
               MESHTX_CACHE_DIR="off", XLA_FLAGS="")
    r = subprocess.run([exe, "plan", "--preset", "tiny", "--mode", "lora", "--seq", "64", "--topology", "v5e:1x1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fits: tpu-v5e yes" in r.stdout and "XLA's compiled program: mode=lora, mesh dp=1 fsdp=1 mp=1" in r.stdout


@pytest.mark.compat   # also under jax 0.7.2, whose XLA:CPU widens bf16 weights to float32 for every product
@pytest.mark.parametrize("mode", ["infer", "lora", "prefill"])
def test_working_memory_does_not_grow_with_depth(mode):
    """At GPT-J-6B's width, three layers need no more working memory than one: each layer's weights are read (or, under
    jaxlib 0.7, widened) one layer at a time, and a prompt is written into the cache in place. Widened freely, 0.7.2's
    scheduler kept every layer's float32 copies alive at once (0.75 GiB more per layer, 21.8 GiB at 28 layers), and its
    scatter copied the whole cache, transposed (4.0 GiB at 28 layers and 2048 slots); measured."""
    cfg = ModelConfig.preset("gptj-6b")
    kw = dict(lora_rank=8, remat=True) if mode == "lora" else dict(prompt=32) if mode == "prefill" else {}
    seq = 2048 if mode == "prefill" else 128
    one, three = (compiled_memory(cfg.replace(n_layer=n), 1, mode.replace("prefill", "infer"), 1, seq, **kw).temporaries
                  for n in (1, 3))
    layer = 12 * cfg.d_model ** 2 * 2                                    # one layer's bf16 weights: 0.375 GiB
    assert three - one < 0.1 * layer, (one / 2**30, three / 2**30)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plan_of_a_lora_step_without_remat_counts_what_each_block_keeps(dtype):
    """Without remat (the `ModelConfig` default), XLA:CPU keeps each block's values for the backward in float32, and
    float32 frozen weights' bf16 copies too: `plan` counted the values at 2 bytes and no copies (0.55-0.63 of XLA's
    bytes per block at GPT-J's width, and 0.75 of the whole step at 3 layers of float32 weights)."""
    cfg = ModelConfig.preset("gptj-6b").replace(n_vocab=1024)
    two, three = (compiled_memory(cfg.replace(n_layer=n), 1, "lora", 1, 256, param_dtype=dtype, lora_rank=8, remat=False)
                  for n in (2, 3))
    per_block = (three.plan.total - two.plan.total) / (three.total - two.total)
    assert 0.9 < per_block < 1.1, per_block
    assert 0.9 < three.plan.total / three.total < 1.1, three.plan.total / three.total
