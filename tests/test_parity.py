"""Logit parity with Hugging Face's PyTorch GPTJForCausalLM, through the real loader and writer.

These are the gold-standard tests; CI runs them a second time under jax==0.7.2 (`-m parity`)."""
import numpy as np
import pytest
from conftest import hf_logits
from meshtx import LM, ModelConfig, KVCache, gptj

pytestmark = [pytest.mark.parity, pytest.mark.transformers4]

CONFIGS = {
    "rotary<d_head": dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=512),
    "rotary==d_head": dict(n_layer=2, d_model=64, n_head=2, rotary_dim=32, n_vocab=512),
    "vocab%8!=0": dict(n_layer=2, d_model=48, n_head=4, rotary_dim=6, n_vocab=1001, d_ff=100),
    "1 layer": dict(n_layer=1, d_model=32, n_head=4, rotary_dim=4, n_vocab=300),
    "3 layers": dict(n_layer=3, d_model=96, n_head=6, rotary_dim=16, n_vocab=777),
    # GPTJForCausalLM's other activations, and its head tied to the embedding (the head's bias stays its own)
    "relu, tied head": dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=300, activation="relu", tie_embeddings=True),
    "gelu (erf)": dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=300, activation="gelu", d_ff=96),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hf(name, hf_checkpoint):
    cfg = ModelConfig(**CONFIGS[name], n_ctx=128)
    path, model = hf_checkpoint(cfg)
    lm = LM.from_hf(path, dtype="float32", progress=False)
    assert lm.config == cfg.replace(eos_token_id=cfg.end_of_text, bos_token_id=cfg.end_of_text)   # + the checkpoint's ids
    tokens = np.random.default_rng(1).integers(0, cfg.n_vocab, (3, 37))
    ref, got = hf_logits(model, tokens), np.asarray(lm.logits(tokens))
    assert np.abs(ref).max() > 1.0, "logits too small for a meaningful comparison"
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_padded_batch_matches_hf(hf_checkpoint):
    "Left-padded prompts with an attention mask: the real tokens' logits match HF's."
    cfg = ModelConfig(**CONFIGS["rotary<d_head"])
    path, model = hf_checkpoint(cfg)
    lm = LM.from_hf(path, dtype="float32", progress=False)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.n_vocab, (2, 12))
    mask = np.ones_like(tokens); mask[0, :5] = 0
    got = np.asarray(lm.logits(tokens, mask))
    for b, start in ((0, 5), (1, 0)):
        ref = hf_logits(model, tokens[b:b + 1, start:])[0]
        np.testing.assert_allclose(got[b, start:], ref, atol=1e-4, rtol=0)


def test_kv_cache_decode_matches_hf(hf_checkpoint):
    "Prefill then token-by-token decoding with the KV cache gives HF's full-sequence logits."
    import jax
    cfg = ModelConfig(**CONFIGS["3 layers"])
    path, model = hf_checkpoint(cfg)
    lm = LM.from_hf(path, dtype="float32", progress=False)
    tokens = np.random.default_rng(3).integers(0, cfg.n_vocab, (2, 20))
    ref = hf_logits(model, tokens)
    step = jax.jit(gptj(cfg).apply)
    logits, cache = step(lm.params, tokens[:, :8], None, KVCache.init(cfg, 2, 32))
    np.testing.assert_allclose(logits, ref[:, :8], atol=1e-4, rtol=0)
    for t in range(8, 20):
        logits, cache = step(lm.params, tokens[:, t:t + 1], None, cache)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], atol=1e-4, rtol=0)


def scaled_params(params, seed):
    "Random params of the same shapes with HF-parity-test scales (see conftest.make_hf_model)."
    import jax
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng, out = np.random.default_rng(seed), []
    for path, x in leaves:
        name = jax.tree_util.keystr(path)
        if "scale" in name: v = 1 + 0.5 * rng.standard_normal(x.shape)
        elif x.ndim - ("blocks" in name) == 1: v = 0.5 * rng.standard_normal(x.shape)
        else: v = 0.2 * rng.standard_normal(x.shape)
        out.append(np.asarray(v, np.float32))
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("name", ["rotary<d_head", "vocab%8!=0", "relu, tied head"])
def test_save_hf_round_trip(name, tmp_path):
    "meshtx -> save_hf -> GPTJForCausalLM.from_pretrained: the same weights, bit for bit, and the same logits."
    import transformers
    cfg = ModelConfig(**CONFIGS[name])
    lm = LM.init(cfg)
    lm.params = scaled_params(lm.params, seed=4)
    lm.save_hf(tmp_path / "out", progress=False)
    model = transformers.GPTJForCausalLM.from_pretrained(tmp_path / "out").eval()
    sd = model.state_dict()
    np.testing.assert_array_equal(sd["transformer.h.1.attn.k_proj.weight"].numpy(),
                                  np.asarray(lm.params["gptj/blocks/attn"]["k"][1]))
    np.testing.assert_array_equal(sd["lm_head.bias"].numpy(), np.asarray(lm.params["gptj/lm_head"]["b"]))
    tokens = np.random.default_rng(5).integers(0, cfg.n_vocab, (2, 16))
    ref, got = hf_logits(model, tokens), np.asarray(lm.logits(tokens))
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_gpt2_tokenizer_from_the_shipped_files():
    "GPT-2's tokenizer, built offline, encodes and decodes as GPT-2 does under transformers 4 and 5."
    from meshtx.tokenizer import gpt2_tokenizer
    tok = gpt2_tokenizer()
    assert tok("Hello world").input_ids == [15496, 995] and tok.eos_token_id == 50256
    text = "Hello , world . It 's ok\n\n"
    assert tok.decode(tok(text).input_ids) == text          # decoding gives the text back, spaces and all
