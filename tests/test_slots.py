"""meshtx.slots: continuous batching gives each prompt what `generate` gives it alone, whatever the order of joins."""
import os, types
import numpy as np
import pytest
import jax
from meshtx import LM, ModelConfig
from meshtx.sharding import make_mesh
from meshtx.slots import Slots

CFG = ModelConfig(n_layer=2, d_model=64, n_head=8, rotary_dim=4, n_vocab=512, n_ctx=128)


@pytest.fixture(scope="module")
def lm():
    lm = LM.init(CFG, seed=1)
    lm.params = jax.tree.map(lambda x: x * 8, lm.params)   # logits O(1): decisive argmaxes
    return lm


def requests(n, seed=0, most_new=80):
    rng = np.random.default_rng(seed)
    return [dict(prompt=rng.integers(0, CFG.n_vocab - 1, int(rng.integers(1, 40))).tolist(),
                 max_new_tokens=int(rng.integers(1, most_new)), temperature=[0.0, 0.8, 1.3][i % 3],
                 top_p=[1.0, 0.9][i % 2], seed=100 + i) for i in range(n)]


def run(slots, reqs, steps=8, **common):
    "Every request through `slots`, each joining as soon as a row is free: {index: Finished}, and the cache lengths seen."
    got, who, waiting, lengths = {}, {}, list(range(len(reqs))), []
    while waiting or any(slots.busy):
        while waiting and slots.free():
            i = waiting.pop(0)
            r = dict(reqs[i]); p = r.pop("prompt")
            who[slots.add([p], **r, **common)[0]] = i
        got |= {who[f.row]: f for f in slots.step(steps)}
        lengths.append(int(slots.state.cache.length))
    return got, lengths


def alone(lm, r, **common):
    r = dict(r); p = r.pop("prompt")
    return lm.generate([p], **r, **common, logprobs=True)


def test_each_prompt_gets_what_generate_gives_it_alone(lm):
    reqs = requests(12)
    want = [alone(lm, r, eos_token_id=None) for r in reqs]
    got, lengths = run(Slots(lm, rows=3, eos_token_id=None), reqs)
    assert [got[i].tokens for i in range(12)] == [w.tokens[0] for w in want]
    assert [got[i].finish_reason for i in range(12)] == [w.finish_reasons[0] for w in want]
    for i in range(12): np.testing.assert_allclose(got[i].logprobs, want[i].logprobs[0], atol=1e-3)   # float32, another order of sums
    assert any(b < a for a, b in zip(lengths, lengths[1:])), lengths   # the cache was repacked on the way


@pytest.mark.compat
@pytest.mark.parametrize("shape", [(2, 1, 4), (1, 2, 4)], ids=["dp2-mp4", "fsdp2-mp4"])
def test_on_a_mesh(lm, shape):
    reqs = requests(6, seed=1, most_new=40)
    want = [alone(lm, r, eos_token_id=None).tokens[0] for r in reqs]
    sharded = LM(CFG, lm.params).shard(make_mesh(*shape, config=CFG))
    slots = Slots(sharded, rows=3, eos_token_id=None)
    assert slots.rows == 4                                  # rounded up to the batch shards
    got, _ = run(slots, reqs)
    assert [got[i].tokens for i in range(6)] == want


def test_end_of_text_and_each_rows_own_stops(lm):
    reqs = requests(9, seed=2)
    free = [alone(lm, r, eos_token_id=None).tokens[0] for r in reqs]
    long = [t for t in free if len(t) >= 8]
    eos = long[0][5]                                   # a token one generation emits, late
    mid = lambda t, n: [t[len(t) // 2:len(t) // 2 + n]] if len(t) >= 8 else None
    stops = [mid(t, 1 + i % 2) if i % 3 else None for i, t in enumerate(free)]   # sequences each generation holds
    want = [alone(lm, r, eos_token_id=eos, stop=s) for r, s in zip(reqs, stops)]
    slots = Slots(lm, rows=4, eos_token_id=eos)
    got, who, waiting = {}, {}, list(range(9))
    while waiting or any(slots.busy):
        while waiting and slots.free():
            i = waiting.pop(0); r = dict(reqs[i]); p = r.pop("prompt")
            who[slots.add([p], stop=stops[i], **r)[0]] = i
        got |= {who[f.row]: f for f in slots.step(5)}
    assert [got[i].tokens for i in range(9)] == [w.tokens[0] for w in want]
    assert [got[i].finish_reason for i in range(9)] == [w.finish_reasons[0] for w in want]
    assert "stop" in {f.finish_reason for f in got.values()}


def test_stop_strings_text_and_top_logprobs():
    demo = LM.init("demo")
    prompts = ["Once upon a time", "The meaning of life is", "JAX is"]
    want = demo.generate(prompts, max_new_tokens=40, temperature=0, stop=["e", "\n"], top_logprobs=3)
    slots = Slots(demo, rows=2, top_logprobs=5)   # the most a row may ask for; each row asks for its own, or none
    ends, asks = {}, [3, None, 3]
    rows = slots.add(prompts[:2], max_new_tokens=40, temperature=0, stop=["e", "\n"], top_logprobs=asks[:2])
    who = dict(zip(rows, range(2)))
    while len(ends) < 3:
        for f in slots.step(4):
            ends[who[f.row]] = f
            if 2 not in who.values():
                who[slots.add(prompts[2], max_new_tokens=40, temperature=0, stop=["e", "\n"], top_logprobs=3)[0]] = 2
    assert [ends[i].text for i in range(3)] == want.texts and [ends[i].tokens for i in range(3)] == want.tokens
    assert ends[1].top_logprobs is None   # the row that did not ask gets none
    for i in (0, 2):
        assert len(ends[i].top_logprobs) == len(want.top_logprobs[i])
        for a, b in zip(ends[i].top_logprobs, want.top_logprobs[i]):
            assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), atol=1e-5)
    with pytest.raises(ValueError, match="these slots offer at most 5"):
        slots.add(prompts[0], top_logprobs=6)
    with pytest.raises(ValueError, match="2 values for 1 prompts"):
        slots.add(prompts[0], top_logprobs=[1, 2])


def test_a_dropped_row_is_free_and_the_next_prompt_is_not_disturbed(lm):
    reqs = requests(2, seed=3)
    slots = Slots(lm, rows=1, eos_token_id=None)
    slots.add([reqs[0]["prompt"]], max_new_tokens=60, temperature=0)
    slots.step(8)
    slots.drop(0)
    assert slots.free() == [0] and slots.step(8) == []
    got, _ = run(slots, reqs[1:])
    assert got[0].tokens == alone(lm, reqs[1], eos_token_id=None).tokens[0]


def test_programs_compile_once_per_shape(lm):
    slots = Slots(lm, rows=5, eos_token_id=None)   # a number of rows no other test uses: its own programs
    fns = slots._fns
    before = (fns.decode._cache_size(), fns.repack._cache_size(), fns.join._cache_size())
    run(slots, requests(10, seed=4), steps=3)
    after = (fns.decode._cache_size(), fns.repack._cache_size(), fns.join._cache_size())
    assert after[0] - before[0] == 1 and after[1] - before[1] <= 1, (before, after)
    # one per prompt-length bucket (16, 32, 64) of one prompt; JAX's count may hold one more entry for the same program
    assert after[2] - before[2] <= 4, (before, after)
    run(slots, requests(10, seed=5), steps=5)   # other prompts, lengths, options and steps per call: nothing new
    assert (fns.decode._cache_size(), fns.repack._cache_size()) == after[:2]
    assert fns.join._cache_size() == after[2]


def test_bad_input_is_named(lm):
    slots = Slots(lm, rows=2)
    with pytest.raises(ValueError, match="invalid rows=0"): Slots(lm, rows=0)
    with pytest.raises(ValueError, match="invalid max_len=1"): Slots(lm, max_len=1)
    short = Slots(lm, rows=2, max_len=16)
    with pytest.raises(ValueError, match="prompt 1 has 10 tokens; with max_new_tokens=8 that exceeds the 16 slots of a row"):
        short.add([[1] * 4, [1] * 10], max_new_tokens=8)
    assert short.free() == [0, 1]
    with pytest.raises(ValueError, match="only 2 of the 2 rows are free"): slots.add([[1]] * 3)
    with pytest.raises(ValueError, match="invalid temperature=-1"): slots.add([[1]], temperature=-1)
    with pytest.raises(ValueError, match="exceeds n_ctx=128"): slots.add([[1] * 100], max_new_tokens=40)
    with pytest.raises(ValueError, match="outside"): slots.add([[CFG.n_vocab]])
    assert slots.free() == [0, 1] and not any(slots.busy)   # nothing was taken
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"invalid steps={bad!r}: an integer ≥ 1"): slots.step(bad)
    for bad in (-1, 2, 1.0):   # -1 is not the last row, nor 1.0 a row
        with pytest.raises(ValueError, match=f"invalid row={bad!r}: a row in \\[0, 2\\)"): slots.drop(bad)
    with pytest.raises(ValueError, match="invalid eos_token_id=5000"): Slots(lm, eos_token_id=5000)


def test_short_rows_give_what_generate_gives(lm):
    "Rows shorter than n_ctx (the memory a server has) hold any request that fits them, repacked as they fill."
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.n_vocab, rng.integers(1, 20)).tolist() for _ in range(6)]
    news = [12, 3, 20, 7, 1, 15]
    want = [lm.generate([p], max_new_tokens=n, temperature=0, eos_token_id=None).tokens[0] for p, n in zip(prompts, news)]
    s, got, who, waiting = Slots(lm, rows=2, max_len=40, eos_token_id=None), {}, {}, list(range(6))
    while waiting or any(s.busy):
        while waiting and s.free():
            i = waiting.pop(0); who[s.add([prompts[i]], max_new_tokens=news[i], temperature=0)[0]] = i
        got |= {who[f.row]: f.tokens for f in s.step(4)}
    assert [got[i] for i in range(6)] == want


def test_the_default_length_fits_the_memory_free(lm):
    from meshtx.slots import slot_length, _free_bytes
    free = _free_bytes(lm)
    assert free and free > 0
    assert slot_length(lm, 4) == 128                          # the tiny model: all of n_ctx, whatever the machine
    big = types.SimpleNamespace(config=ModelConfig(n_layer=1, d_model=4096, n_head=16, rotary_dim=64, n_vocab=64, n_ctx=2048), mesh=None)
    per_slot = 2 * 4096 * 4 * 8                                # float32 keys and values of one slot of 8 rows
    n = slot_length(big, 8, share=2048 * per_slot * 4 / free)  # room for 4 × the cache: all of it
    assert n == 2048, n
    n = slot_length(big, 8, share=300 * per_slot / free)       # room for 300 slots: 256
    assert n == 256, n
    assert slot_length(big, 8, share=1 / free) == 64           # no room: the least


def test_the_cache_is_held_once():
    """The slots hold one cache and never two at once, not even while they are made (at GPT-J-6B's 8 × 512 float32
    rows, 3.8 GB each): measured as the high-water mark of a process of its own, with a 1 GB cache, beyond what making
    an empty cache alone reaches (the state is made from one, donated: without that, the cache was copied)."""
    import subprocess, sys, textwrap
    code = textwrap.dedent("""
        import jax
        from meshtx import LM, ModelConfig
        from meshtx.slots import Slots
        hwm = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
        from meshtx.sampling import _compiled
        lm = LM.init(ModelConfig(n_layer=2, d_model=4096, n_head=16, rotary_dim=64, d_ff=64, n_vocab=512, n_ctx=2048))
        jax.block_until_ready(_compiled(lm).empty_cache(8, 2048))
        before = hwm()
        s = Slots(lm, rows=8, max_len=2048)
        s.add([[1, 2, 3]], max_new_tokens=4, temperature=0)
        s.step(2)
        jax.block_until_ready(s.state)
        print(hwm() - before, s.state.cache.k.nbytes + s.state.cache.v.nbytes)""")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    grew, cache = map(int, r.stdout.split())
    assert grew < 0.5 * cache, (grew / 1e9, cache / 1e9)


def test_text_after_the_prompt_and_streamed_byte_runs():
    "Rows' texts continue their prompts (a Llama-2-style first space kept); what `text` shows only grows, to the final text."
    from test_sampling import sp_tokenizer
    tok = sp_tokenizer()
    lm = LM.init(ModelConfig(n_layer=1, d_model=32, n_head=2, rotary_dim=8, n_vocab=len(tok), n_ctx=64), tokenizer=tok)
    ban = {i: -100 for s, i in tok.get_vocab().items() if not s.startswith("<0x") and s != "▁one"}
    kw = dict(max_new_tokens=12, temperature=1.0, seed=3, logit_bias=ban)
    slots = Slots(lm, rows=2, eos_token_id=None)
    (r,) = slots.add(["meshtx runs"], **kw)
    shown, done = [], []
    while not done:
        done = slots.step(1)
        if not done: shown.append(slots.text(r))
    g = lm.generate("meshtx runs", eos_token_id=None, **kw)
    assert done[0].text == g.texts[0] and done[0].tokens == g.tokens[0]
    assert all(s.startswith(t) for t, s in zip(shown, shown[1:] + [g.texts[0]]))
