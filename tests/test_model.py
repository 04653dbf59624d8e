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


def test_products_widen_where_the_cpu_cannot_mix_dtypes(monkeypatch):
    "On a CPU whose jaxlib refuses bf16 x bf16 = f32 (0.7), `einsum32` widens the inputs: the same logits, to bf16 rounding."
    import numpy as np
    import meshtx.model as M
    from meshtx import LM
    x, w = jnp.ones((1, 3, 8), jnp.bfloat16), jnp.full((4, 8), 0.5, jnp.bfloat16)
    native = str(jax.make_jaxpr(lambda a, b: M.einsum32("...i,oi->...o", a, b))(x, w))
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=257, n_ctx=64,
                      param_dtype="bfloat16", compute_dtype="bfloat16")
    tokens = [[1, 2, 3, 4, 5]]
    before = np.asarray(LM.init(cfg, seed=0, tokenizer=None).logits(tokens))
    monkeypatch.setattr(M, "cpu_mixed_products", lambda: False)
    widened = str(jax.make_jaxpr(lambda a, b: M.einsum32("...i,oi->...o", a, b))(x, w))
    assert "convert_element_type" not in native and "convert_element_type" in widened, (native, widened)
    assert float(M.einsum32("...i,oi->...o", x, w)[0, 0, 0]) == 4.0
    after = np.asarray(LM.init(cfg, seed=0, tokenizer=None).logits(tokens))   # a new model: traced again, widened
    np.testing.assert_allclose(after, before, atol=0.05)
    assert (after.argmax(-1) == before.argmax(-1)).mean() >= 0.8
