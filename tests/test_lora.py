"""LoRA: a frozen base, trained adapters, merging and export to Hugging Face."""
import numpy as np
import numpy.testing as npt
import jax, jax.numpy as jnp
import pytest
from conftest import hf_logits
from meshtx import LM
from meshtx.config import ModelConfig, LoRAConfig
from meshtx.lora import split_adapters
from meshtx.sharding import make_mesh
from meshtx.train import Trainer

CFG = ModelConfig(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=300, n_ctx=64)


def batches(seed=0, accum=1, batch=4, seq=16):
    rng = np.random.default_rng(seed)
    text = rng.integers(0, CFG.n_vocab, 400)
    while True:
        idx = rng.integers(0, len(text) - seq - 1, accum * batch)
        yield np.stack([text[i:i + seq + 1] for i in idx]).reshape(accum, batch, seq + 1)


def test_lora_trains_adapters_only_merges_and_exports_to_hf(hf_checkpoint, tmp_path):
    import transformers
    path, _ = hf_checkpoint(CFG)
    lm = LM.from_hf(path, dtype="float32", tokenizer=None, progress=False)
    base = jax.tree.map(np.array, lm.params)
    t = Trainer(lm, batches(), lora=LoRAConfig(rank=4, alpha=8, targets=("q", "v", "out", "fc_in", "fc_out")),
                lr=1e-2, progress=False)
    losses = [t.step()["loss"] for _ in range(6)]
    assert losses[-1] < losses[0]
    frozen, adapters = split_adapters(lm.params)
    jax.tree.map(npt.assert_array_equal, frozen, base)                      # the base is bitwise untouched
    assert "lora_k_a" not in adapters["gptj/blocks/attn"]                    # only the chosen targets
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(adapters)) > 0
    tokens = np.random.default_rng(1).integers(0, CFG.n_vocab, (2, 20))
    with_adapters = np.asarray(lm.logits(tokens))
    assert np.abs(with_adapters - np.asarray(LM(CFG, base).logits(tokens))).max() > 1e-3   # the adapters matter
    lm.save_adapters(tmp_path / "adapters")
    lm.merge_lora()
    npt.assert_allclose(np.asarray(lm.logits(tokens)), with_adapters, atol=1e-5)
    lm.save_hf(tmp_path / "merged", progress=False)
    hf = transformers.GPTJForCausalLM.from_pretrained(tmp_path / "merged").eval()
    npt.assert_allclose(hf_logits(hf, tokens), with_adapters, atol=1e-4)
    # the adapters alone, attached to a fresh copy of the base, give the same model again
    again = LM.from_hf(path, dtype="float32", tokenizer=None, progress=False).load_adapters(tmp_path / "adapters")
    npt.assert_allclose(np.asarray(again.logits(tokens)), with_adapters, atol=1e-6)


@pytest.mark.compat
def test_lora_on_a_mesh_matches_one_device():
    def run(mesh):
        lm = LM.init(CFG, seed=3, mesh=mesh)
        t = Trainer(lm, batches(seed=2, accum=2), lora=4, lr=1e-3, progress=False)
        return [t.step()["loss"] for _ in range(3)], jax.tree.map(np.asarray, split_adapters(lm.params)[1])
    ref_losses, ref = run(None)
    losses, got = run(make_mesh(dp=2, fsdp=2, mp=2, devices=jax.devices()[:8]))
    npt.assert_allclose(losses, ref_losses, atol=1e-5)
    jax.tree.map(lambda a, b: npt.assert_allclose(a, b, atol=1e-5), got, ref)


def test_lora_config_errors():
    with pytest.raises(ValueError, match="'wq'"): LoRAConfig(targets=["wq"])
    lm = LM.init(CFG)
    with pytest.raises(ValueError, match="no LoRA adapters"): lm.merge_lora()
    lm.add_lora(2)
    with pytest.raises(ValueError, match="already has LoRA"): lm.add_lora(2)
    gptj = LM.init("tiny")   # GPT-J's MLP has no gate: fc_gate alone adapts nothing, beside others it is skipped
    with pytest.raises(ValueError, match=r"GPT-J's MLP has no gate \(fc_gate\)"): gptj.add_lora(LoRAConfig(rank=2, targets=["fc_gate"]))
    gptj.add_lora(LoRAConfig(rank=2, targets=["q", "fc_gate"]))


KILL_AT = """
import os, signal, sys
def kill_at(event, ends):   # SIGKILL this process right before filesystem step `event` whose destination ends with `ends`
    sys.addaudithook(lambda ev, args: os.kill(os.getpid(), signal.SIGKILL)
                     if ev == event and str(args[1] if len(args) > 1 else args[0]).endswith(ends) else None)
"""


def test_save_adapters_killed_between_its_renames_keeps_the_earlier_adapters(tmp_path):
    "Killed after moving the earlier adapters aside, before moving the new ones in: the next load puts them back."
    import subprocess, sys, warnings
    lm = LM.init(CFG).add_lora(4, seed=0)
    lm.params = jax.tree_util.tree_map_with_path(lambda p, x: x + 1 if "lora" in str(p) else x, lm.params)   # B != 0
    lm.save_adapters(tmp_path / "adapters")
    code = KILL_AT + f"""
from meshtx import LM, ModelConfig
lm = LM.init(ModelConfig.from_dict({CFG.to_dict()!r})).add_lora(4, seed=1)
kill_at("os.rename", "/adapters")
lm.save_adapters({str(tmp_path / "adapters")!r})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    assert not (tmp_path / "adapters").exists()                 # the moment the kill left: the earlier ones aside
    with warnings.catch_warnings(record=True):
        back = LM.init(CFG).load_adapters(tmp_path / "adapters")
    tokens = np.arange(1, 9)[None]
    npt.assert_array_equal(np.asarray(back.logits(tokens)), np.asarray(lm.logits(tokens)))
    LM.init(CFG).add_lora(4, seed=2).save_adapters(tmp_path / "adapters")   # a later save leaves nothing beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters"]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["/out/adapters", "/out/model"])
def test_finetune_killed_while_saving_its_result_resumes(kill_at, tmp_path):
    "The same finetune call again finishes a run killed while writing its adapters or its final model."
    import subprocess, sys
    from meshtx.runs import finetune
    from meshtx.tokenizer import ByteTokenizer
    LM.init(ModelConfig(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=257, n_ctx=64),
            tokenizer=ByteTokenizer()).save(tmp_path / "base")
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    args = dict(lora=4, steps=2, batch=2, seq=32, val_fraction=0.2, progress=False)
    code = KILL_AT + f"""
from meshtx.runs import finetune
kill_at("os.rename", {kill_at!r})
finetune({str(tmp_path / "base")!r}, {str(tmp_path / "text.txt")!r}, {str(tmp_path / "out")!r}, **{args!r})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr
    assert not (tmp_path / "out" / "model" / "config.json").exists()
    result = finetune(tmp_path / "base", tmp_path / "text.txt", tmp_path / "out", **args, log=lambda *a: None)
    lm = LM.load(result["model"], progress=False)
    assert lm.logits([1, 2, 3]).shape == (1, 3, 257)
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]   # no leftovers


def test_adapters_keep_the_models_generation_config(tmp_path):
    "Adding, loading and merging adapters keeps a chat model's generation_config.json (its end tokens, sampling defaults) for its saves."
    lm = LM.init(CFG, seed=0)
    lm.generation_config = gen = {"eos_token_id": [3, 4], "temperature": 0.7}
    lm.add_lora(4)
    assert lm.generation_config == gen
    lm.save_adapters(tmp_path / "ad")
    other = LM.init(CFG, seed=0)
    other.generation_config = gen
    assert other.load_adapters(tmp_path / "ad").generation_config == gen
    lm.merge_lora().save(tmp_path / "merged")
    assert lm.generation_config == gen and LM.load(tmp_path / "merged").generation_config == gen
