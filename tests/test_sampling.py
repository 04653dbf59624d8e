"""lm.generate: Hugging Face's greedy decoding token for token, HF's filter definitions, seeds, meshes, compiles."""
import numpy as np
import pytest
import jax, jax.numpy as jnp
from meshtx import LM, ModelConfig
from meshtx.sampling import apply_repetition_penalty, top_k_filter, top_p_filter, _compiled
from meshtx.sharding import make_mesh

CONFIGS = {
    "rotary<d_head": dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=512, n_ctx=128),
    "3 layers, odd vocab": dict(n_layer=3, d_model=48, n_head=6, rotary_dim=4, n_vocab=301, n_ctx=128),
}


def prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, n).tolist() for n in lengths]


def hf_greedy(model, batch, new, eos):
    import torch
    P = max(map(len, batch))
    ids = torch.full((len(batch), P), eos); mask = torch.zeros((len(batch), P), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, P - len(p):] = torch.tensor(p); mask[i, P - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)[:, P:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


@pytest.mark.parity
@pytest.mark.transformers4
@pytest.mark.parametrize("read", ["chunks", "all"])
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_hf_generate(name, read, hf_checkpoint):
    "Both ways of reading the KV cache (the filled chunks: CPU and TPU; all slots: GPU) decode as HF does."
    cfg = ModelConfig(**CONFIGS[name])
    path, model = hf_checkpoint(cfg)
    lm = LM.from_hf(path, dtype="float32", progress=False, cache_read=read)
    assert lm.config.cache_read == read
    batch = prompts(cfg.n_vocab, [5, 17, 1, 30])
    eos = model.config.eos_token_id
    ref = hf_greedy(model, batch, 64, eos)
    got = lm.generate(batch, max_new_tokens=64, temperature=0)
    assert got.tokens == ref
    assert sum(map(len, ref)) > 100                       # mostly full-length rows: a real comparison
    assert lm.generate(batch, max_new_tokens=64, top_k=1, seed=3).tokens == ref    # top_k=1 is greedy


def test_filters_match_hf_warpers():
    import torch
    from transformers.generation.logits_process import (TopKLogitsWarper, TopPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 40)).astype(np.float32) * 3
    for k in (1, 5, 40):
        ref = TopKLogitsWarper(k)(None, torch.tensor(logits)).numpy()
        got = np.asarray(top_k_filter(jnp.asarray(logits), jnp.full((3,), k)))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    for p in (0.05, 0.5, 0.9, 0.999):
        ref = TopPLogitsWarper(p)(None, torch.tensor(logits)).numpy()
        got = np.asarray(top_p_filter(jnp.asarray(logits), jnp.full((3,), p, jnp.float32)))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    assert np.isfinite(np.asarray(top_p_filter(jnp.asarray(logits), jnp.ones(3)))).all()     # top_p=1 keeps all
    ids = rng.integers(0, 40, (3, 7))
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor(ids), torch.tensor(logits)).numpy()
    seen = np.zeros((3, 40), bool); np.put_along_axis(seen, ids, True, axis=1)
    got = np.asarray(apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), jnp.full((3,), 1.7)))
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_token_zero_can_be_filtered():
    logits = jnp.array([[0.0, 5.0, 4.0, -1.0]])          # token 0 is not among the top 2
    assert not np.isfinite(np.asarray(top_k_filter(logits, jnp.array([2]))))[0, 0]
    assert not np.isfinite(np.asarray(top_p_filter(logits, jnp.array([0.9]))))[0, 0]


def test_seeds():
    lm = LM.init("tiny")
    a = lm.generate([[1, 2, 3]], max_new_tokens=32, seed=11, eos_token_id=None).tokens
    b = lm.generate([[1, 2, 3]], max_new_tokens=32, seed=11, eos_token_id=None).tokens
    c = lm.generate([[1, 2, 3]], max_new_tokens=32, seed=12, eos_token_id=None).tokens
    assert a == b and a != c
    # per-row: a row's sample does not depend on the other rows in the batch
    d = lm.generate([[1, 2, 3], [9, 9]], max_new_tokens=32, seed=[11, 5], eos_token_id=None).tokens
    assert d[0] == a[0]


def test_logprobs_and_stop_and_stream():
    lm = LM.init("demo")
    g = lm.generate(["Hello", "The quick brown"], max_new_tokens=12, temperature=0, logprobs=True)
    ref = np.asarray(jax.nn.log_softmax(lm.logits(lm.tokenizer("Hello").input_ids + g.tokens[0][:1])[0, -2]))
    assert abs(g.logprobs[0][0] - ref[g.tokens[0][0]]) < 1e-4
    words = g.texts[1].split()
    if len(words) > 2:                                   # cut at a stop string that occurs in the greedy text
        s = lm.generate("The quick brown", max_new_tokens=12, temperature=0, stop=[words[2]])
        assert words[2] not in s.texts[0] and s.finish_reasons == ["stop"]
    streamed = "".join(t for _, t in lm.generate("The quick brown", max_new_tokens=12, temperature=0, stream=True, steps_per_call=3))
    assert streamed == g.texts[1]


def test_a_stop_string_found_by_the_host_cuts_the_tokens_in_the_call_that_reaches_the_limit():
    """A stop string across two tokens is the host's to find (its own tokens differ); when the row also reaches
    max_new_tokens in that device call, its tokens and log-probabilities still end at the token that completes it,
    in `generate`, its stream and the slots alike."""
    from meshtx.slots import Slots
    lm = LM.init("demo")
    prompt = "The quick brown"
    free = lm.generate(prompt, max_new_tokens=12, temperature=0)
    piece = lambda t: lm.tokenizer.decode([t])
    for j in range(len(free.tokens[0]) - 3):    # a stop made of one token's last characters and the next one's first
        a, b = piece(free.tokens[0][j]), piece(free.tokens[0][j + 1])
        stop = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and stop not in lm.tokenizer.decode(free.tokens[0][:j + 1]): break
    else: pytest.skip("no two long tokens in a row")   # (the demo model's greedy text has them)
    n = j + 4   # more than the two tokens, within one device call
    g = lm.generate(prompt, max_new_tokens=n, temperature=0, stop=[stop], steps_per_call=16, logprobs=True)
    assert (len(g.tokens[0]), len(g.logprobs[0]), g.finish_reasons[0]) == (j + 2, j + 2, "stop"), (j, stop, g)
    streamed = lm.generate(prompt, max_new_tokens=n, temperature=0, stop=[stop], steps_per_call=16, stream=True)
    assert "".join(p for _, p in streamed) == g.texts[0] and streamed.tokens[0] == g.tokens[0]
    slots = Slots(lm, rows=1, max_len=64)
    slots.add(prompt, max_new_tokens=n, temperature=0, stop=[stop])
    done = slots.step(16)
    assert (done[0].tokens, done[0].text, done[0].finish_reason) == (g.tokens[0], g.texts[0], "stop")


def test_bad_options_are_named():
    lm = LM.init("tiny")
    for kw, msg in [({"top_p": -0.5}, "invalid top_p=-0.5"), ({"top_k": -2}, "invalid top_k=-2"), ({"top_p": 1.5}, "invalid top_p=1.5"), ({"top_k": 0.5}, "invalid top_k=0.5"),
                    ({"temperature": -1}, "invalid temperature=-1"), ({"temperature": float("nan")}, "invalid temperature=nan"),
                    ({"repetition_penalty": 0}, "invalid repetition_penalty=0"), ({"max_new_tokens": 0}, "invalid max_new_tokens=0"),
                    ({"temperature": [1.0, 0.5]}, "temperature has 2 values for 1 prompts")]:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
            lm.generate([[1, 2]], **kw)
    with pytest.raises(ValueError, match="exceeds n_ctx=128"):
        lm.generate([list(range(1, 100))], max_new_tokens=64)
    out = lm.generate([list(range(1, 100))], max_new_tokens=64, truncate="left", temperature=0, eos_token_id=None)
    assert len(out.tokens[0]) == 64


def test_compiles_do_not_grow_with_prompt_length():
    lm = LM.init("tiny")
    lm.generate([[1]], max_new_tokens=10, temperature=0)
    fns = _compiled(lm)
    p0, d0 = fns.prefill._cache_size(), fns.decode._cache_size()
    for n in (2, 7, 13, 21, 30):
        lm.generate([list(range(1, n + 1))], max_new_tokens=10, temperature=0)
    assert fns.prefill._cache_size() - p0 <= 1 and fns.decode._cache_size() - d0 <= 1, \
        (fns.prefill._cache_size() - p0, fns.decode._cache_size() - d0)


@pytest.mark.compat
@pytest.mark.parametrize("shape,read", [((1, 1, 8), "chunks"), ((2, 1, 4), "chunks"), ((2, 1, 4), "all")],
                         ids=["mp8", "dp2-mp4", "dp2-mp4-all-slots"])
def test_mesh_output_equals_single_device(shape, read):
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=8, rotary_dim=4, n_vocab=512, n_ctx=128, cache_read=read)
    ref = LM.init(cfg, seed=1)
    ref.params = jax.tree.map(lambda x: x * 8, ref.params)     # logits O(1): decisive argmaxes
    batch = prompts(cfg.n_vocab, [3, 9, 4, 12])
    want_g = ref.generate(batch, max_new_tokens=24, temperature=0, eos_token_id=None)
    want_s = ref.generate(batch, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=[1, 2, 3, 4], eos_token_id=None)
    lm = LM(cfg, ref.params).shard(make_mesh(*shape, config=cfg))
    assert lm.generate(batch, max_new_tokens=24, temperature=0, eos_token_id=None).tokens == want_g.tokens
    assert lm.generate(batch, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=[1, 2, 3, 4], eos_token_id=None).tokens == want_s.tokens


def _hf_default_greedy(path, batch, new):
    "HF's `generate` as a user calls it on a saved checkpoint: its own eos, bos and pad from config.json."
    import torch, transformers
    model = transformers.GPTJForCausalLM.from_pretrained(path).eval()
    eos = model.generation_config.eos_token_id
    P = max(map(len, batch))
    ids = torch.zeros((len(batch), P), dtype=torch.long); mask = torch.zeros((len(batch), P), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, P - len(p):] = torch.tensor(p); mask[i, P - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)[:, P:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


@pytest.mark.parity
@pytest.mark.transformers4
def test_checkpoints_own_end_token(tmp_path):
    """A checkpoint whose config.json names its own eos (one the model emits, or one outside its vocabulary, as
    GPTJConfig's default 50256 is for a small vocabulary): generation stops where HF's does, and save_hf keeps it."""
    import json
    from conftest import make_hf_model
    cfg = ModelConfig(**CONFIGS["rotary<d_head"])
    batch = prompts(cfg.n_vocab, [5, 17, 1, 30])
    model = make_hf_model(cfg)
    for k in ("eos_token_id", "bos_token_id"): setattr(model.config, k, 50256); setattr(model.generation_config, k, 50256)
    model.save_pretrained(tmp_path / "outside")
    free = _hf_default_greedy(tmp_path / "outside", batch, 24)
    assert all(len(r) == 24 for r in free)                # 50256 cannot be emitted: HF never stops early
    lm = LM.from_hf(tmp_path / "outside", dtype="float32", progress=False)
    assert lm.eos_token_id == 50256 and lm.generate(batch, max_new_tokens=24, temperature=0).tokens == free

    at, eos = next((i, t) for i, t in enumerate(free[0]) if i >= 3 and t not in free[0][:i])   # first emitted late
    for k, v in dict(eos_token_id=eos, bos_token_id=5, pad_token_id=0).items():
        setattr(model.config, k, v); setattr(model.generation_config, k, v)
    model.save_pretrained(tmp_path / "own")
    ref = _hf_default_greedy(tmp_path / "own", batch, 24)
    assert len(ref[0]) == at + 1 and ref[0][-1] == eos
    lm = LM.from_hf(tmp_path / "own", dtype="float32", progress=False)
    assert lm.generate(batch, max_new_tokens=24, temperature=0).tokens == ref
    lm.save_hf(tmp_path / "again", progress=False)        # the round trip keeps the checkpoint's tokens
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (saved["eos_token_id"], saved["bos_token_id"], saved["pad_token_id"]) == (eos, 5, 0)
    assert saved["architectures"] == ["GPTJForCausalLM"]
    assert _hf_default_greedy(tmp_path / "again", batch, 24) == ref


def test_layering_lm_above_sampling():
    "`meshtx.sampling` takes the model as an argument and never imports `meshtx.lm`; `lm` imports it only inside `generate`."
    import ast, inspect
    import meshtx.lm, meshtx.sampling
    def top_imports(module):
        tree = ast.parse(inspect.getsource(module))
        return {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not {m for m in top_imports(meshtx.sampling) if m and m.split(".")[-1] == "lm"}
    assert not {m for m in top_imports(meshtx.lm) if m and m.split(".")[-1] == "sampling"}
    assert not hasattr(LM, "_text") and not hasattr(LM, "_chunks")    # no private helpers patched onto LM
    assert LM.generate.__module__ == "meshtx.lm"


def decisive(seed=0, scale=8):
    "The tiny model with its weights scaled up: logits of O(1) and more (std 0.6 at scale 2, 10 at 8): clear-cut greedy choices."
    lm = LM.init("tiny", seed=seed)
    lm.params = jax.tree.map(lambda x: x * scale, lm.params)
    return lm


def test_seeded_samples_are_those_of_earlier_releases():
    "Presence/frequency penalties, the logit bias and per-row steps changed the sampler: a seed still gives the same text."
    g = LM.init("tiny").generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=12, temperature=[0.9, 1.2], top_k=[0, 40],
                                 top_p=[0.95, 1.0], repetition_penalty=[1.0, 1.3], seed=[3, 77], eos_token_id=None)
    assert g.tokens == [[781, 832, 196, 207, 590, 938, 1, 728, 534, 414, 921, 98],      # meshtx 76cdab8's
                        [993, 254, 41, 82, 543, 927, 59, 544, 870, 747, 770, 361]]


def numpy_greedy(lm, prompt, new, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    "Greedy decoding by recomputing the logits in full each step, with the penalties and bias applied in NumPy."
    seq, counts = list(prompt), np.zeros(lm.config.n_vocab)
    for _ in range(new):
        x = np.asarray(lm.logits(seq)[0, -1], np.float64) + (0 if bias is None else bias)
        seen = np.zeros(lm.config.n_vocab, bool); seen[seq] = True
        x = np.where(seen, np.where(x < 0, x * repetition, x / repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        t = int(np.argmax(x)); seq.append(t); counts[t] += 1
    return seq[len(prompt):]


@pytest.mark.parametrize("presence,frequency,repetition", [(0.0, 1.5, 1.0), (0.5, 0.3, 1.2), (-1.0, -0.5, 1.0)])
def test_presence_and_frequency_penalties_equal_numpy(presence, frequency, repetition):
    lm, favour = decisive(scale=2), {5: 3.0, 9: 2.5}     # a model that would say 5 5 5 ... : penalties have work to do
    bias = np.zeros(lm.config.n_vocab); bias[list(favour)] = list(favour.values())
    batch = prompts(lm.config.n_vocab, [3, 7])
    g = lm.generate(batch, max_new_tokens=12, temperature=0, presence_penalty=presence, frequency_penalty=frequency,
                    repetition_penalty=repetition, logit_bias=favour, eos_token_id=None)
    for p, toks in zip(batch, g.tokens):
        assert toks == numpy_greedy(lm, p, 12, presence, frequency, repetition, bias)
    plain = lm.generate(batch, max_new_tokens=12, temperature=0, logit_bias=favour, eos_token_id=None).tokens
    assert all(len(set(t)) <= 2 for t in plain)
    if presence > 0 or frequency > 0: assert g.tokens != plain, g.tokens   # pushed off 5 5 5 (where 5 leads by less)
    # per row: the penalized row and an unpenalized one in one batch
    mixed = lm.generate(batch, max_new_tokens=12, temperature=0, presence_penalty=[presence, 0], frequency_penalty=[frequency, 0],
                        repetition_penalty=[repetition, 1], logit_bias=favour, eos_token_id=None).tokens
    assert mixed == [g.tokens[0], plain[1]]


def test_logit_bias_forces_and_bans_tokens():
    lm = decisive()
    V, batch = lm.config.n_vocab, prompts(lm.config.n_vocab, [4, 6])
    plain = lm.generate(batch, max_new_tokens=8, temperature=0, eos_token_id=None).tokens
    first = plain[1][0]
    g = lm.generate(batch, max_new_tokens=8, temperature=1.0, seed=3, logit_bias=[{17: 100}, {first: -100}], eos_token_id=None)
    assert g.tokens[0] == [17] * 8                                   # sampled, yet forced
    assert g.tokens[1][0] != first
    banned = np.zeros(V); banned[first] = -100
    greedy = lm.generate(batch[1], max_new_tokens=8, temperature=0, logit_bias={first: -100.0}, eos_token_id=None).tokens[0]
    assert greedy == numpy_greedy(lm, batch[1], 8, bias=banned) and first not in greedy
    # the same bias for every row, and numpy keys
    both = lm.generate(batch, max_new_tokens=3, temperature=0, logit_bias={np.int64(5): 100}, eos_token_id=None).tokens
    assert both == [[5, 5, 5], [5, 5, 5]]


@pytest.mark.parametrize("kw,msg", [
    ({"presence_penalty": 2.5}, "invalid presence_penalty=2.5"), ({"frequency_penalty": -3}, "invalid frequency_penalty=-3"),
    ({"frequency_penalty": "x"}, "invalid frequency_penalty='x'"), ({"presence_penalty": [0, 1]}, "presence_penalty has 2 values for 1 prompts"),
    ({"logit_bias": {1024: 1}}, "invalid logit_bias={1024: ...}: token ids are integers in [0, 1024)"),
    ({"logit_bias": {-1: 1}}, "invalid logit_bias={-1: ...}"), ({"logit_bias": {"7": 1}}, "invalid logit_bias={'7': ...}"),
    ({"logit_bias": {7: 150}}, "invalid logit_bias={7: 150}: a bias is a number in [-100, 100]"),
    ({"logit_bias": {7: float("nan")}}, "invalid logit_bias={7: nan}"), ({"logit_bias": [7]}, "invalid logit_bias=7"),
    ({"logit_bias": [{}, {}]}, "invalid logit_bias=<2 dicts>: give one for each of the 1 prompts"),
    ({"top_logprobs": -1}, "invalid top_logprobs=-1"), ({"top_logprobs": 2.0}, "invalid top_logprobs=2.0"),
    ({"top_logprobs": 5000}, "invalid top_logprobs=5000: an integer in [0, 1024]"),
    ({"stop": [[1]] * 17}, "invalid stop=<17 sequences>: at most 16"), ({"stop": [list(range(1, 66))]}, "1 to 64 token ids"),
    ({"stop": -1}, "invalid stop=[-1]: token ids are in [0, 1024)"), ({"stop": [[5, 5000]]}, "invalid stop=[5, 5000]"),
    ({"stop": 10**10}, "invalid stop=[10000000000]"), ({"stop": True}, "invalid stop=True"), ({"stop": [1.5]}, "invalid stop=1.5"),
    ({"steps_per_call": 0}, "invalid steps_per_call=0: an integer ≥ 1"), ({"steps_per_call": 2.5}, "invalid steps_per_call=2.5"),
    ({"temperature": True}, "invalid temperature=True"), ({"temperature": "0.5"}, "invalid temperature='0.5'"),
    ({"top_k": True}, "invalid top_k=True"), 
    ({"seed": True}, "invalid seed=True"), ({"max_new_tokens": True}, "invalid max_new_tokens=True"), ({"repetition_penalty": True}, "invalid repetition_penalty=True"),
    ({"eos_token_id": 5000}, "invalid eos_token_id=5000: a token id in [0, 1024), None or 'auto'"),
    ({"eos_token_id": "x"}, "invalid eos_token_id='x'"),
])
def test_bad_new_options_are_named(kw, msg):
    import re
    with pytest.raises(ValueError, match=re.escape(msg)):
        LM.init("tiny").generate([[1, 2]], **{"max_new_tokens": 2, **kw})


def test_top_logprobs_are_the_models_own():
    """`top_logprobs=k`: per token, the log-softmax of `lm.logits` (float32, 1e-5) for the k likeliest and the chosen
    token, whatever the sampler did to its own distribution (temperature, top-k, a bias); the same once a stream ends."""
    lm = decisive(1, scale=2)
    batch = prompts(lm.config.n_vocab, [5, 2])
    g = lm.generate(batch, max_new_tokens=6, temperature=[0.7, 1.3], top_k=[0, 50], logit_bias=[None, {3: 4.0}], seed=9,
                    top_logprobs=3, logprobs=True, eos_token_id=None)
    for p, toks, tops, sampler in zip(batch, g.tokens, g.top_logprobs, g.logprobs):
        assert len(tops) == len(toks) == 6
        for t, (tok, top) in enumerate(zip(toks, tops)):
            ref = np.asarray(jax.nn.log_softmax(lm.logits(p + toks[:t])[0, -1].astype(jnp.float32)))
            best = np.argsort(-ref)[:3]
            assert list(top)[:3] == best.tolist() and tok in top and len(top) == 3 + (tok not in best)
            for i, lp in top.items(): assert abs(lp - ref[i]) < 1e-5, (t, i, lp, ref[i])
        assert any(abs(s - top[tok]) > 1e-3 for s, tok, top in zip(sampler, toks, tops))   # the sampler's are other numbers
    s = lm.generate(batch, max_new_tokens=6, temperature=[0.7, 1.3], top_k=[0, 50], logit_bias=[None, {3: 4.0}], seed=9,
                    top_logprobs=3, eos_token_id=None, stream=True, steps_per_call=2)
    assert s.top_logprobs is None
    list(s)                                              # (no text: the tiny model has no tokenizer)
    assert s.tokens == g.tokens
    assert all(abs(a[k] - b[k]) < 1e-6 for ra, rb in zip(s.top_logprobs, g.top_logprobs) for a, b in zip(ra, rb) for k in a)
    assert lm.generate(batch, max_new_tokens=2).top_logprobs is None
    alone = lm.generate(batch, max_new_tokens=6, temperature=[0.7, 1.3], top_k=[0, 50], logit_bias=[None, {3: 4.0}], seed=9,
                        top_logprobs=0, eos_token_id=None)            # 0: the chosen token's own log-probability only
    assert alone.top_logprobs == [[{t: top[t]} for t, top in zip(toks, tops)] for toks, tops in zip(g.tokens, g.top_logprobs)]


def test_top_logprobs_sizes_and_stops_compile_a_few_programs():
    "k is rounded up to 5, 20, ...: k = 0..5 is one decode program; stop lists of any size and length share one shape."
    lm = LM.init("tiny")
    fns = _compiled(lm)
    lm.generate([[1, 2]], max_new_tokens=4, top_logprobs=1)
    d0 = fns.decode._cache_size()
    for k in (0, 2, 3, 4, 5): lm.generate([[1, 2]], max_new_tokens=4, top_logprobs=k)
    assert fns.decode._cache_size() == d0
    for k in (6, 11, 20): lm.generate([[1, 2]], max_new_tokens=4, top_logprobs=k)
    assert fns.decode._cache_size() == d0 + 1
    lm.generate([[1, 2]], max_new_tokens=4, temperature=0)
    d1 = fns.decode._cache_size()
    for stop in ([5], [[5, 6, 7]], [[1]] * 16, [list(range(1, 65))], None, []):
        lm.generate([[1, 2]], max_new_tokens=4, temperature=0, stop=stop)
    assert fns.decode._cache_size() == d1


def sp_tokenizer():
    "A tiny Llama-2-style tokenizer, built offline: Metaspace, byte fallback (`<0xNN>`), a Strip decoder, adds `<s>`."
    import json
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, normalizers
    from meshtx.config import quiet_transformers
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    t.train_from_iterator(["meshtx runs the families one two three on one chip"] * 4,
                          trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    d = json.loads(t.to_str())
    for b in range(256): d["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(d["model"]["vocab"]))
    d["model"]["byte_fallback"] = True
    d["decoder"] = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    d["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    return quiet_transformers().PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)),
                                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sp_lm():
    tok = sp_tokenizer()
    return LM.init(ModelConfig(n_layer=1, d_model=32, n_head=2, rotary_dim=8, n_vocab=len(tok), n_ctx=64), tokenizer=tok)


def hf_pipeline_text(tok, prompt_ids, new):
    "What HF's text-generation pipeline returns without the prompt: the whole decode, past the prompt's own."
    return tok.decode(prompt_ids + new, skip_special_tokens=True)[len(tok.decode(prompt_ids, skip_special_tokens=True)):]


def test_a_stream_of_byte_tokens_joins_to_the_text(sp_lm):
    # only byte tokens: invalid runs, whose decoded text changes at its end as more bytes come (HF's ByteFallback)
    tok = sp_lm.tokenizer
    ban = {i: -100 for s, i in tok.get_vocab().items() if not s.startswith("<0x")}
    kw = dict(max_new_tokens=12, temperature=1.0, seed=1, eos_token_id=None, logit_bias=ban)
    g = sp_lm.generate("meshtx runs", **kw)
    toks = g.tokens[0]
    assert any(not tok.decode(toks).startswith(tok.decode(toks[:k])) for k in range(len(toks)))   # the text did change
    assert g.texts[0] == tok.decode(toks)
    for chunk in (1, 3):
        assert "".join(p for _, p in sp_lm.generate("meshtx runs", stream=True, steps_per_call=chunk, **kw)) == g.texts[0]


def test_the_completion_keeps_its_leading_space(sp_lm):
    tok = sp_lm.tokenizer
    one = tok.convert_tokens_to_ids("▁one")
    kw = dict(max_new_tokens=3, temperature=0, eos_token_id=None, logit_bias={one: 100})
    ids = tok("meshtx runs").input_ids
    g = sp_lm.generate("meshtx runs", **kw)
    assert g.tokens[0] == [one] * 3 and g.texts[0] == hf_pipeline_text(tok, ids, g.tokens[0]) == " one one one"
    assert "".join(p for _, p in sp_lm.generate("meshtx runs", stream=True, steps_per_call=1, **kw)) == g.texts[0]
    g = sp_lm.generate("meshtx runs", stop=["e o"], **kw)   # stop strings still cut where the text holds them
    assert g.texts[0] == " on" and g.tokens[0] == [one, one] and g.finish_reasons == ["stop"]
    assert sp_lm.generate("", **kw).texts[0] == hf_pipeline_text(tok, tok("").input_ids, [one] * 3) == "one one one"


def test_truncate_left_keeps_the_start_token(sp_lm):
    tok = sp_lm.tokenizer
    prompt = "meshtx runs the families " * 20
    g = sp_lm.generate(prompt, max_new_tokens=8, temperature=0, truncate="left", eos_token_id=None)
    tok.truncation_side = "left"
    hf = tok(prompt, truncation=True, max_length=64 - 8).input_ids
    assert hf[0] == 1 and len(tok(prompt).input_ids) > len(hf)
    assert g.tokens == sp_lm.generate([hf], max_new_tokens=8, temperature=0, eos_token_id=None).tokens
    from meshtx.sampling import _fit
    assert _fit(sp_lm, [tok(prompt).input_ids], np.array([8]), "left") == [hf]
