"""The widgets in a real browser: a notebook served by Voila (kernel on 127.0.0.1), driven by Debian's Chromium through
Playwright. Skipped only where Chromium is not installed (CI installs it: `apt-get install chromium`); with
`MESHTX_REQUIRE_BROWSER=1` (set by .ci/run) a missing Chromium fails instead.

Each test screenshots the widget before, during the first compile and after, into its tmp_path and into
`/tmp/widget-shots/` (`$MESHTX_WIDGET_SHOTS`) for a person to look at; and checks in the page what a person would
see: a status that says what is happening while the model compiles, no label cut off, no box past the page's edge
(at a 1000 px wide page). On a failure the page and Voila's log go to `$MESHTX_ARTIFACTS` or `tests/artifacts/`."""
import contextlib, os, re, shutil, time
from pathlib import Path
import pytest
from browser_util import (CHROMIUM_ARGS, artifacts_dir, chromium_path, image_src, ipywidgets771_env, overflowing,
                          page_errors, set_widget_value, shoot, tail, truncated_labels, voila_server, wait_for_widget,
                          wait_until, widget_text, write_notebook)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PAGE_TIMEOUT = 150     # s: Voila runs the whole notebook (JAX import, model init) before the page shows
COMPILE_TIMEOUT = 120  # s: the kernel's first JAX compile of a step or of generation, on 2 busy cores
SHOTS = Path(os.environ.get("MESHTX_WIDGET_SHOTS", "/tmp/widget-shots"))


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    if exe is None:
        if os.environ.get("MESHTX_REQUIRE_BROWSER") == "1":
            pytest.fail("MESHTX_REQUIRE_BROWSER=1 but Chromium is not installed (apt-get install chromium)")
        pytest.skip("Chromium is not installed (apt-get install chromium); the real-browser widget tests need it")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try: yield b
        finally: b.close()


@pytest.fixture
def voila(tmp_path, browser):
    """Factory: serve a notebook made of `cells` with Voila (`env`: variables to add); yields (url, log path). Voila and
    its kernel are always ended at teardown. (Depends on `browser` so that nothing starts where the test would be skipped.)"""
    with contextlib.ExitStack() as stack:
        def serve(*cells, name="nb", env=None):
            nb = write_notebook(tmp_path / f"{name}.ipynb", *cells)
            return stack.enter_context(voila_server(nb, timeout=60, env=env))
        yield serve


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1000, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(COMPILE_TIMEOUT * 1000)
    try: yield pg
    finally: ctx.close()


@contextlib.contextmanager
def diagnosed(page, log, name):
    "On a failure: a screenshot, the page's HTML and Voila's log into the artifacts folder, and the log in the message."
    try:
        yield
    except Exception as e:
        out = artifacts_dir(name)
        with contextlib.suppress(Exception): page.screenshot(path=str(out / "FAILED.png"), full_page=True)
        with contextlib.suppress(Exception): (out / "FAILED.html").write_text(page.content())
        with contextlib.suppress(Exception): shutil.copy(log, out / "voila.log")
        errs = ""
        with contextlib.suppress(Exception): errs = page_errors(page)
        raise AssertionError(f"{e}\n--- page outputs:\n{errs[-3000:]}\n--- voila log:\n{tail(log)}\n"
                             f"(artifacts in {out})") from e


def looks_finished(page, when):
    "Nothing cut off, nothing past the page's right edge."
    assert not (cut := truncated_labels(page)), f"{when}: labels cut off: {cut}"
    assert not (over := overflowing(page)), f"{when}: boxes past the page's edge: {over}"


def activity(page, i=0):
    "The text of the i-th widget's activity line (what it says it is doing)."
    return page.evaluate("i => document.querySelectorAll('.meshtx-activity')[i]?.innerText ?? ''", i) or ""


def spinning(page, i=0):
    return page.evaluate("i => !!document.querySelectorAll('.meshtx-activity')[i]?.querySelector('.meshtx-spinner')", i)


SAMPLER_SETUP = "from meshtx import LM\nimport meshtx.widgets as W\nlm = LM.init('demo')"


def test_sampler_widget_in_browser(voila, page, tmp_path):
    url, log = voila(SAMPLER_SETUP, "W.SamplerWidget(lm)", name="sampler")
    with diagnosed(page, log, "sampler"):
        wait_for_widget(page, url, ".meshtx-prompt", PAGE_TIMEOUT)
        for cls in ("generate", "stop", "output", "stats", "error", "activity", "temperature", "top-p", "top-k",
                    "max-tokens", "repetition-penalty", "seed", "stop-at"):
            assert page.locator(f".meshtx-{cls}").count() == 1, f"no element with class meshtx-{cls}"
        assert page.locator(".meshtx-stop").is_disabled(), "Stop is enabled before generating"
        assert "appears here" in widget_text(page, "meshtx-output")
        set_widget_value(page, "meshtx-prompt", "Once upon a time")
        set_widget_value(page, "meshtx-max-tokens", 400)   # long enough to watch it stream and stop it
        assert widget_text(page, "meshtx-max-tokens") == "400"
        looks_finished(page, "before")
        shoot(page, tmp_path / "sampler-1-before.png", SHOTS)
        page.click(".meshtx-generate")
        # the first generation compiles: the widget says so, with a spinner, while nothing has come yet
        wait_until(lambda: "compiling the model" in activity(page), 15, msg="'compiling the model' after Generate")
        assert spinning(page) and not widget_text(page, "meshtx-continuation")
        looks_finished(page, "during the compile")
        shoot(page, tmp_path / "sampler-2-compiling.png", SHOTS)
        # streaming: the continuation grows in several steps while the generation runs, and the status says so
        n1 = len(wait_until(lambda: widget_text(page, "meshtx-continuation"), COMPILE_TIMEOUT, msg="the first tokens"))
        seen = [n1]
        def grew_twice():
            n = len(widget_text(page, "meshtx-continuation") or "")
            if n != seen[-1]: seen.append(n)
            return len(seen) >= 3
        wait_until(grew_twice, COMPILE_TIMEOUT, interval=0.05, msg="the output to grow twice while streaming")
        assert seen == sorted(seen), f"the output shrank while streaming: {seen} characters"
        assert activity(page).startswith("generating"), activity(page)
        assert page.locator(".meshtx-stop").is_enabled(), "Stop is disabled while generating"
        page.click(".meshtx-stop")
        # stopped: Generate comes back, the output stays as it is, the status and the stats say how it went
        page.wait_for_selector(".meshtx-generate:not([disabled])", timeout=30_000)
        m1 = widget_text(page, "meshtx-continuation")
        time.sleep(1.0)
        m2 = widget_text(page, "meshtx-continuation")
        assert m1 == m2, f"the output kept growing after Stop: {len(m1)} -> {len(m2)} characters"
        assert len(m1) >= seen[-1]
        assert widget_text(page, "meshtx-prompt-text") == "Once upon a time"   # shown with its continuation
        assert re.fullmatch(r"stopped after [\d.]+ s", activity(page)), activity(page)
        assert not spinning(page)
        stats = widget_text(page, "meshtx-stats")
        assert re.search(r"time to first token", stats) and re.search(r"[\d.]+ tokens/s", stats), stats
        n_tokens = int(re.search(r"(\d+) tokens\b(?!/)", stats).group(1))
        assert n_tokens < 400, f"Stop did not stop the generation early: {stats}"
        assert page.locator(".meshtx-stop").is_disabled()
        assert not widget_text(page, "meshtx-error").strip(), widget_text(page, "meshtx-error")
        # the text is shown in normal contrast, not greyed out as a disabled box would be
        color = page.evaluate("() => getComputedStyle(document.querySelector('.meshtx-continuation')).color")
        assert color in ("rgb(17, 17, 17)", "rgb(0, 0, 0)"), color
        looks_finished(page, "after")
        shoot(page, tmp_path / "sampler-3-after.png", SHOTS)


def _step(page):
    s = widget_text(page, "meshtx-status") or ""
    m = re.search(r"step (\d+)", s)
    return int(m.group(1)) if m else None


FINETUNE_SETUP = """import itertools, numpy as np
from meshtx import LM
from meshtx.train import Trainer
import meshtx.widgets as W
lm = LM.init("tiny")
batch = np.tile(np.arange(10, 26), 40)[:4*33].reshape(1, 4, 33)
t = Trainer(lm, itertools.repeat(batch), val_data=[batch[0]], lr=3e-3, total_steps=200, progress=False)"""


def test_finetune_widget_in_browser(voila, page, tmp_path):
    url, log = voila(FINETUNE_SETUP, "W.FinetuneWidget(t)", name="finetune")
    with diagnosed(page, log, "finetune"):
        wait_for_widget(page, url, ".meshtx-step", PAGE_TIMEOUT)
        for cls in ("start", "pause", "save", "progress", "status", "plot-placeholder", "sample", "activity"):
            assert page.locator(f".meshtx-{cls}").count() == 1, f"no element with class meshtx-{cls}"
        assert _step(page) == 0, widget_text(page, "meshtx-status")
        # no broken image before the first step: a line of text stands where the plot will be
        assert page.locator(".meshtx-plot-placeholder").is_visible() and not page.locator(".meshtx-plot").count()
        assert "appears after the first step" in widget_text(page, "meshtx-plot-placeholder")
        looks_finished(page, "before")
        shoot(page, tmp_path / "finetune-1-before.png", SHOTS)
        # one step by hand: the first compiles the train step, and the widget says so
        page.click(".meshtx-step")
        wait_until(lambda: "compiling the train step" in activity(page), 15, msg="'compiling the train step' after Step")
        assert spinning(page)
        looks_finished(page, "during the compile")
        shoot(page, tmp_path / "finetune-2-compiling.png", SHOTS)
        wait_until(lambda: _step(page) == 1, COMPILE_TIMEOUT, msg="'step 1' after Step")
        src1 = wait_until(lambda: image_src(page, "meshtx-plot"), 10, msg="the plot after step 1")
        wait_until(lambda: page.locator(".meshtx-plot").is_visible(), 10, msg="the plot to show")
        assert not page.locator(".meshtx-plot-placeholder").count()
        wait_until(lambda: re.fullmatch(r"1 step in [\d.]+ s", activity(page)), 10, msg="'1 step in … s'")
        # background training: the counter advances, the status names the step, the plot is redrawn
        page.click(".meshtx-start")
        wait_until(lambda: re.search(r"training step \d+ / 200", activity(page)), 30, msg="'training step N / 200…'")
        wait_until(lambda: (_step(page) or 0) >= 3, 30, msg="the step counter to advance after Start")
        wait_until(lambda: image_src(page, "meshtx-plot") not in (None, src1), 30, msg="the plot to change")
        assert page.locator(".meshtx-pause").is_enabled(), "Pause is disabled while training"
        assert page.locator(".meshtx-step").is_disabled(), "Step is enabled while training"
        page.click(".meshtx-pause")
        page.wait_for_selector(".meshtx-start:not([disabled])", timeout=30_000)
        s1 = _step(page)
        time.sleep(1.5)
        s2 = _step(page)
        assert s1 == s2, f"training went on after Pause: step {s1} -> {s2}"
        assert 3 <= s1 < 200, f"paused at step {s1}"
        assert activity(page) == f"paused after step {s1}" and not spinning(page), activity(page)
        progress = page.evaluate("() => document.querySelector('.meshtx-progress .progress-bar')?.style.width")
        assert progress and progress != "0%", f"progress bar width {progress!r}"
        assert not widget_text(page, "meshtx-error").strip(), widget_text(page, "meshtx-error")
        looks_finished(page, "after")
        shoot(page, tmp_path / "finetune-3-after.png", SHOTS)


def test_both_widgets_under_ipywidgets_7(voila, page, tmp_path):
    """Colab's ipywidgets 7.7.1 (the overlay tools/test.sh installs): the same layout checks, and the status during
    the first compile, for both widgets on one page."""
    env = ipywidgets771_env()
    if env is None: pytest.skip("the ipywidgets 7.7.1 overlay is not installed (tools/test.sh installs it)")
    url, log = voila("import ipywidgets\nassert ipywidgets.__version__ == '7.7.1', ipywidgets.__version__\n" + SAMPLER_SETUP,
                     "W.SamplerWidget(lm, prompt='Once upon a time')",
                     "open('a.txt', 'w').write('A short text about foxes and dogs. ' * 300)\n"
                     "f = W.FinetuneWidget(LM.init('demo'), workdir='work', eval_every=2)\n"
                     "f.data_path.value, f.seq.value, f.batch.value, f.steps.value = 'a.txt', 32, 4, 2\nf",
                     name="ipywidgets7", env=env)
    with diagnosed(page, log, "ipywidgets7"):
        wait_for_widget(page, url, ".meshtx-prepare", PAGE_TIMEOUT)
        looks_finished(page, "before")
        shoot(page, tmp_path / "ipywidgets7-1-before.png", SHOTS)
        page.click(".meshtx-generate")
        wait_until(lambda: "compiling the model" in activity(page, 0), 15, msg="'compiling the model' after Generate")
        looks_finished(page, "during the compile")
        shoot(page, tmp_path / "ipywidgets7-2-compiling.png", SHOTS)
        wait_until(lambda: activity(page, 0).startswith("done in"), COMPILE_TIMEOUT, msg="the generation to end")
        page.click(".meshtx-prepare")   # 'Prepare data' says what it prepared
        wait_until(lambda: re.search(r"prepared \d+ windows of 32 tokens", widget_text(page, "meshtx-data-info") or ""),
                   COMPILE_TIMEOUT, msg="'prepared N windows of 32 tokens'")
        page.wait_for_selector(".meshtx-start:not([disabled])", timeout=30_000)
        page.click(".meshtx-start")
        wait_until(lambda: "compiling the train step" in activity(page, 1), 15, msg="'compiling the train step'")
        wait_until(lambda: activity(page, 1).startswith("done: 2 steps"), COMPILE_TIMEOUT, msg="training to end")
        wait_until(lambda: page.locator(".meshtx-plot").count() and page.locator(".meshtx-plot").is_visible(), 30,
                   msg="the plot in the placeholder's place")
        assert widget_text(page, "meshtx-continuation") and not page.locator(".meshtx-plot-placeholder").count()
        looks_finished(page, "after")
        shoot(page, tmp_path / "ipywidgets7-3-after.png", SHOTS)
