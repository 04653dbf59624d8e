"""The widgets in-process (no browser): set values, click buttons, read the controllers and the views.
Run on ipywidgets 8 and, by tools/test.sh, again on 7.7.1 (Colab's version)."""
import itertools, time, types
import numpy as np
import pytest
import ipywidgets
from meshtx import LM
from meshtx.train import Trainer
from meshtx.widgets import SamplerWidget, FinetuneWidget, _uploaded

pytestmark = pytest.mark.widgets

PATTERN = np.tile(np.arange(10, 26), 40)[: 4 * 33].reshape(1, 4, 33)


@pytest.fixture(scope="module")
def lm():
    import meshtx.sampling  # noqa: F401
    return LM.init("demo")


def test_sampler_generates_streams_and_stops(lm):
    w = SamplerWidget(lm, prompt="The meaning of life is")
    w.temperature.value, w.max_tokens.value, w.seed.value = 0.0, 10, 3
    w.generate_button.click()
    assert w.controller.wait(60)
    assert w.output.value == lm.generate("The meaning of life is", max_new_tokens=10, temperature=0).texts[0]
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
    assert w.controller.n_tokens < 400 and w.output.value == w.controller.text
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
    assert "saved" in w.status.value and w.error.value == ""
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
    w.step_button.click()
    assert w.controller.wait(60)
    assert w.controller.steps_done == 1 and lm.lora is not None
    w.controller.eval_every = 2                                 # step 2 evaluates and previews a sample
    w.start_button.click()
    assert w.controller.wait(120)
    assert w.controller.steps_done == 3 and "done: 3 steps" in w.status.value
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
