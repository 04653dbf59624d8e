"""GPT-J-6B itself, abstractly: its parameter count and that its forward lowers fast on a CPU."""
import time
import jax, jax.numpy as jnp
from meshtx import ModelConfig, gptj, param_shapes


def test_gptj_6b_param_count():
    cfg = ModelConfig.preset("gptj-6b")
    assert cfg.n_params == 6_050_882_784
    assert sum(x.size for x in jax.tree.leaves(param_shapes(cfg))) == 6_050_882_784


def test_gptj_6b_forward_lowers_under_30s():
    cfg = ModelConfig.preset("gptj-6b", param_dtype="bfloat16", compute_dtype="bfloat16")
    t0 = time.perf_counter()
    lowered = jax.jit(gptj(cfg).apply).lower(param_shapes(cfg), jax.ShapeDtypeStruct((1, 2048), jnp.int32))
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    out = lowered.out_info
    assert out.shape == (1, 2048, 50400) and out.dtype == jnp.float32
