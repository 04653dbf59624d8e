"""The widgets in-process (no browser): set values, click buttons, read the controllers and the views.
Run on ipywidgets 8 and, by tools/test.sh, again on 7.7.1 (Colab's version)."""
import html, itertools, re, time, types
import numpy as np
import pytest
import ipywidgets
from meshtx import LM
from meshtx.train import Trainer
from meshtx.widgets import COMPILING, COMPILING_STEP, PLOT_PLACEHOLDER, FinetuneWidget, SamplerWidget, _uploaded

pytestmark = pytest.mark.widgets

PATTERN = np.tile(np.arange(10, 26), 40)[: 4 * 33].reshape(1, 4, 33)


@pytest.fixture(scope="module")
def lm():
    return LM.init("demo")


def test_sampler_generates_streams_and_stops(lm):
    w = SamplerWidget(lm, prompt="The meaning of life is")
    w.temperature.value, w.max_tokens.value, w.seed.value = 0.0, 10, 3
    w.generate_button.click()
    assert w.controller.wait(60)
    assert w.controller.text == lm.generate("The meaning of life is", max_new_tokens=10, temperature=0).texts[0]
    assert html.escape(w.controller.text) in w.output.value and "The meaning of life is" in w.output.value
    assert w.stats.value.startswith("time to first token") and w.controller.n_tokens > 0
    assert not w.generate_button.disabled and w.stop_button.disabled
    # a long generation, stopped after its first pieces
    w.max_tokens.value, w.temperature.value = 400, 1.0
    seen = []
    w.controller.on_update = lambda c: (seen.append(len(c.text)), w._refresh(c))
    w.generate_button.click()
    assert w.generate_button.disabled and not w.stop_button.disabled
    deadline = time.time() + 60
    while not seen and time.time() < deadline: time.sleep(0.01)
    w.stop_button.click()
    assert w.controller.wait(60)
    assert w.controller.n_tokens < 400 and html.escape(w.controller.text) in w.output.value
    assert re.fullmatch(r"stopped after [\d.]+ s", w.controller.activity) and "spinner" not in w.activity.value
    assert sorted(seen) == seen                                 # the text only grew while streaming


def test_sampler_shows_errors_in_words(lm):
    w = SamplerWidget(lm, prompt="x")
    w.new_seed.value, w.seed.value = False, -1
    w.generate_button.click()
    w.controller.wait(60)
    assert "seed" in w.error.value and "Traceback" not in w.error.value
    assert not w.generate_button.disabled


def test_finetune_widget_step_start_pause_save(tmp_path):
    t = Trainer(LM.init("tiny"), itertools.repeat(PATTERN), val_data=[PATTERN[0]], lr=3e-3, total_steps=400,
                checkpoint_dir=str(tmp_path / "ck"), progress=False)
    w = FinetuneWidget(t, eval_every=5, plot_every=1)
    w.step_button.click()                                       # one step, in the background
    assert w.controller.wait(60)
    assert w.controller.steps_done == 1 and w.status.value.startswith("step 1 / 400")
    first_plot = w.plot.value
    w.start_button.click()
    assert w.start_button.disabled and not w.pause_button.disabled
    deadline = time.time() + 60
    while w.controller.steps_done < 8 and time.time() < deadline: time.sleep(0.05)
    w.pause_button.click()
    assert w.controller.wait(60)
    stopped_at = w.controller.steps_done
    assert 8 <= stopped_at < 400
    time.sleep(0.5)
    assert w.controller.steps_done == stopped_at                # paused means paused
    assert w.progress.value == stopped_at and w.plot.value != first_plot
    assert "val" in w.status.value
    w.save_button.click()
    assert "saved" in w.activity.value and w.error.value == ""
    from meshtx.checkpoint import Checkpointer
    assert Checkpointer(tmp_path / "ck").steps() == [stopped_at]


def test_finetune_widget_builds_a_trainer_from_files(tmp_path):
    (tmp_path / "a.txt").write_text("A short text about foxes and dogs. " * 200)
    lm = LM.init("demo")
    w = FinetuneWidget(lm, workdir=str(tmp_path / "work"))
    assert w.start_button.disabled                              # nothing to train yet
    w.build_button.click()
    assert "data path" in w.error.value                         # said in words
    w.data_path.value = str(tmp_path / "a.txt")
    w.seq.value, w.batch.value, w.steps.value, w.lora_rank.value = 32, 4, 3, 4
    w.build_button.click()
    assert w.error.value == "" and w.controller is not None and not w.start_button.disabled
    # it says what it prepared: the windows, their length, the held-out ones, the documents
    info = re.sub("<[^>]+>", "", w.data_info.value)
    m = re.fullmatch(r"prepared (\d+) windows of 32 tokens \(\+(\d+) held out\) from 1 document in 1 file", info)
    assert m, info
    n_tokens = len(lm.tokenizer.encode("A short text about foxes and dogs. " * 200)) + 1   # + the end-of-text token
    assert int(m[1]) + int(m[2]) == n_tokens // 33
    w.step_button.click()
    assert w.controller.wait(60)
    assert w.controller.steps_done == 1 and lm.lora is not None
    w.controller.eval_every = 2                                 # step 2 evaluates and previews a sample
    w.start_button.click()
    assert w.controller.wait(120)
    assert w.controller.steps_done == 3 and "done: 3 steps" in w.activity.value
    assert "sample" in w.sample.value and w.controller.last_sample and "val" in w.status.value
    # a new build is a new run from the base weights: rank 0 trains them all, another rank gets fresh adapters
    w.lora_rank.value = 0
    w.build_button.click()
    assert w.error.value == "" and lm.lora is None and not w.controller.trainer.frozen
    w.lora_rank.value = 2
    w.build_button.click()
    assert w.error.value == "" and lm.lora.rank == 2
    w.lr.value = float("nan")                                    # refused in words, before it can write NaN weights
    w.build_button.click()
    assert "lr=nan" in w.error.value


def test_uploads_on_both_ipywidgets_versions():
    v7 = types.SimpleNamespace(value={"a.txt": {"metadata": {"name": "a.txt"}, "content": b"hello"}})
    v8 = types.SimpleNamespace(value=({"name": "a.txt", "type": "text/plain", "size": 5, "content": memoryview(b"hello")},))
    assert _uploaded(v7) == _uploaded(v8) == [("a.txt", b"hello")]
    assert ipywidgets.__version__.split(".")[0] in ("7", "8")


def test_sampler_says_what_it_is_doing():
    """A fresh model's first generation says it is compiling until the first piece, then that it is generating, then
    how long it took; the view shows a spinner only while it runs. The next generation does not say it compiles."""
    lm = LM.init("demo")
    w = SamplerWidget(lm, prompt="Once upon a time", temperature=0)
    w.max_tokens.value = 24
    seen = []
    w.controller.on_update = lambda c: (w._refresh(c), seen.append((c.activity, c.text, "meshtx-spinner" in w.activity.value)))
    w.generate_button.click()
    assert w.controller.activity == COMPILING and "meshtx-spinner" in w.activity.value   # at once, before the thread
    assert w.controller.wait(120)
    activities = list(dict.fromkeys(a for a, _, _ in seen))
    assert activities[0] == COMPILING and all(not text for a, text, _ in seen if a == COMPILING)
    assert any(re.fullmatch(r"generating… \d+ tokens", a) for a in activities), activities
    assert re.fullmatch(r"done in [\d.]+ s", activities[-1]), activities
    assert seen[-1][2] is False and re.fullmatch(r"done in [\d.]+ s", re.sub("<[^>]+>", "", w.activity.value))
    seen.clear()
    w.generate_button.click()
    assert w.controller.wait(120) and seen[0][0] == "generating…"
    assert COMPILING not in [a for a, _, _ in seen]


def test_finetune_says_what_it_is_doing_and_shows_a_placeholder(tmp_path):
    t = Trainer(LM.init("tiny"), itertools.repeat(PATTERN), val_data=[PATTERN[0]], lr=3e-3, total_steps=4, progress=False)
    w = FinetuneWidget(t, eval_every=2, plot_every=1)
    # before the first step: a line of text where the plot will be, not an empty (broken) image
    assert w.plot_area.children == (w.plot_placeholder,) and PLOT_PLACEHOLDER in w.plot_placeholder.value
    assert w.plot.value == b""
    seen = []
    w.controller.on_update = lambda c: (seen.append((c.activity, c.running)), w._refresh(c))
    w.start_button.click()
    assert w.controller.wait(120)
    activities = list(dict.fromkeys(a for a, _ in seen))
    assert activities[:3] == [COMPILING_STEP, "training step 2 / 4…", "compiling the evaluation (first time only)…"], activities
    assert "training step 3 / 4…" in activities and "evaluating…" in activities   # compiled once: said no more
    assert re.fullmatch(r"done: 4 steps \(4 in [\d.]+ s\)", activities[-1]), activities
    assert all(running for a, running in seen[:-1]) and not seen[-1][1]
    assert w.plot_area.children == (w.plot,) and w.plot.value[:4] == b"\x89PNG"
    assert w.progress.bar_style == "success" and "meshtx-spinner" not in w.activity.value
    # a Step click names its step and says how long it took; a failure is said in words, not as a status
    w.controller.total_steps = 10; w.progress.max = 10
    w.step_button.click(); assert w.controller.wait(60)
    assert re.fullmatch(r"1 step in [\d.]+ s", w.controller.activity)
    w.save_button.click()
    assert "no checkpoint directory" in w.error.value and w.controller.activity == ""


def _text(h): return html.unescape(re.sub("<[^>]+>", "", h))


def test_sampler_options_are_shown_as_given_or_refused(lm):
    "Values `generate` takes are kept by the controls (not clamped to a slider's range); one it cannot use is refused."
    w = SamplerWidget(lm, temperature=3.0, repetition_penalty=0.8, top_k=lm.config.n_vocab + 100)
    assert (w.temperature.value, w.repetition_penalty.value, w.top_k.value) == (3.0, 0.8, lm.config.n_vocab + 100)
    assert w.max_tokens.max == lm.config.n_ctx - 1
    with pytest.raises(ValueError, match=f"max_new_tokens={lm.config.n_ctx} leaves no room for a prompt"):
        SamplerWidget(lm, max_new_tokens=lm.config.n_ctx)


def test_sampler_stop_strings_may_hold_a_bar(lm):
    w = SamplerWidget(lm, prompt="Hello", stop_at=["a|b", "|", "c\\"], temperature=0)
    assert w.stop_at.value == "a\\|b|\\||c\\\\"                     # a bar in a stop string is written \|
    w.max_tokens.value = 4
    w.generate_button.click(); assert w.controller.wait(60)
    assert w.controller.options["stop_at"] == ["a|b", "|", "c\\"]   # the same strings back, none split at its bar
    w.stop_at.value = "x\\|y|\\n"                                   # typed by hand
    w.generate_button.click(); assert w.controller.wait(60)
    assert w.controller.options["stop_at"] == ["x|y", "\n"]


def test_sampler_counts_generated_tokens_and_says_what_its_rate_measures(lm):
    w = SamplerWidget(lm, prompt="Once upon a time", temperature=0, seed=5)
    w.max_tokens.value = 16                                         # two device calls of 8 steps
    counts = []
    w.controller.on_update = lambda c: (counts.append(c.n_tokens), w._refresh(c))
    w.generate_button.click(); assert w.controller.wait(60)
    g = lm.generate("Once upon a time", max_new_tokens=16, temperature=0)
    assert w.controller.n_tokens == len(g.tokens[0]) and w.controller.text == g.texts[0]
    live = [n for n in counts if n is not None]
    assert live[0] == 8 and live == sorted(live)                    # the first piece came with the first call's 8
    stats = _text(w.stats.value)
    assert re.fullmatch(rf"time to first token \d+ ms · {len(g.tokens[0])} tokens · [\d.]+ tokens/s after the first 8", stats), stats


def test_sampler_bad_option_keeps_the_last_result(lm):
    w = SamplerWidget(lm, prompt="Hello", temperature=0)
    w.max_tokens.value = 8
    w.generate_button.click(); assert w.controller.wait(60)
    output, stats, activity = w.output.value, w.stats.value, w.activity.value
    assert w.controller.text and "tokens" in stats
    w.new_seed.value, w.seed.value = False, -1
    w.generate_button.click()
    assert "seed" in w.error.value
    assert (w.output.value, w.stats.value, w.activity.value) == (output, stats, activity)


def test_sampler_says_it_compiles_again_after_new_adapters():
    lm = LM.init("demo")
    w = SamplerWidget(lm, prompt="Hello", temperature=0)
    w.max_tokens.value = 4
    seen = []
    w.controller.on_update = lambda c: (seen.append(c.activity), w._refresh(c))
    firsts = []
    for change in (None, None, lambda: lm.add_lora(2), None):
        if change: change()
        seen.clear(); w.generate_button.click(); assert w.controller.wait(120)
        firsts.append(seen[0])
    assert firsts == [COMPILING, "generating…", COMPILING, "generating…"], firsts


def test_finetune_widget_refuses_a_bad_plot_every():
    t = Trainer(LM.init("tiny"), itertools.repeat(PATTERN), lr=3e-3, total_steps=10, progress=False)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=re.escape(f"plot_every={bad!r} must be an integer ≥ 1")):
            FinetuneWidget(t, plot_every=bad)


def _upload(name, data: bytes):   # what FileUpload.value reads (ipywidgets 8's shape; `_uploaded` reads 7's too)
    return types.SimpleNamespace(value=({"name": name, "type": "text/plain", "size": len(data), "content": memoryview(data)},))


def test_finetune_build_uses_only_the_current_upload(tmp_path):
    lm = LM.init("demo")
    a, b = "Alpha apples are awesome. " * 100, "Bravo bananas be brilliant, bold and bright. " * 150
    w = FinetuneWidget(lm, workdir=str(tmp_path / "work"))
    w.seq.value, w.batch.value, w.steps.value, w.lora_rank.value = 32, 2, 4, 2
    for text in (a, b):
        w.upload = _upload(f"{text[0]}.txt", text.encode())
        w.build_button.click()
        assert w.error.value == "", w.error.value
        info = _text(w.data_info.value)                                # this upload's windows alone, from its one file
        m = re.fullmatch(r"prepared (\d+) windows of 32 tokens(?: \(\+(\d+) held out\))? from 1 document in 1 file", info)
        assert m, info
        assert int(m[1]) + int(m[2] or 0) == (len(lm.tokenizer.encode(text)) + 1) // 33


def test_finetune_failed_build_keeps_the_run_and_its_adapters(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("A short text about foxes and dogs. " * 100)
    lm = LM.init("demo")
    lm.generation_config = {"temperature": 0.6, "eos_token_id": [50256]}
    w = FinetuneWidget(lm, workdir=str(tmp_path / "work"), eval_every=None)
    w.data_path.value = str(tmp_path / "a.txt")
    w.seq.value, w.batch.value, w.steps.value, w.lora_rank.value = 32, 2, 5, 4
    w.build_button.click()
    w.step_button.click(); assert w.controller.wait(60) and w.controller.steps_done == 1
    run, info, lora, params, compiled = w.controller, w.data_info.value, lm.lora, lm.params, lm.compiled
    work = tmp_path / "work"
    data = {p: p.read_bytes() for p in (work / "run-1" / "data").rglob("*") if p.is_file()}

    def still_the_run():
        assert w.controller is run and w.data_info.value == info and not w.start_button.disabled
        assert lm.lora == lora and lm.params is params and lm.compiled is compiled
        assert lm.generation_config == {"temperature": 0.6, "eos_token_id": [50256]}
        assert w.run_dir == work / "run-1" and sorted(p.name for p in work.glob("run-*")) == ["run-1"]
        assert {p: p.read_bytes() for p in (work / "run-1" / "data").rglob("*") if p.is_file()} == data   # its data as it was

    w.data_path.value = str(tmp_path / "a.tx")                      # a typo
    w.build_button.click()
    assert "a.tx" in _text(w.error.value); still_the_run()
    w.data_path.value, w.lr.value = str(tmp_path / "a.txt"), float("nan")
    w.build_button.click()
    assert "lr=nan" in w.error.value; still_the_run()
    w.lr.value = 3e-4
    import meshtx.widgets
    def broken(*a, **k): raise RuntimeError("no trainer today")
    monkeypatch.setattr(meshtx.widgets, "Trainer", broken)          # fails after the model was reset to its base
    w.build_button.click()
    assert "no trainer today" in w.error.value; still_the_run()
    monkeypatch.undo()
    w.step_button.click(); assert w.controller.wait(60)             # the run goes on
    assert w.error.value == "" and w.controller.steps_done == 2
    w.save_button.click(); assert w.controller.wait(60) and "run-1/checkpoints/step_00000002" in w.activity.value
    w.build_button.click()                                          # a new run, from the base: generation_config kept
    assert w.error.value == "" and w.controller is not run and lm.lora.rank == 4
    assert lm.generation_config == {"temperature": 0.6, "eos_token_id": [50256]}
    # in a folder of its own: its first checkpoint is not refused for the run before's later one, which stays
    w.step_button.click(); assert w.controller.wait(60)
    w.save_button.click(); assert w.controller.wait(60)
    assert w.error.value == "" and "run-2/checkpoints/step_00000001" in w.activity.value and w.run_dir == work / "run-2"
    from meshtx.checkpoint import Checkpointer
    assert Checkpointer(work / "run-1" / "checkpoints").steps() == [2]
