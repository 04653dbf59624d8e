"""The widgets in a real browser: a notebook served by Voila (kernel on 127.0.0.1), driven by Debian's Chromium through
Playwright. Skipped only where Chromium is not installed (CI installs it: `apt-get install chromium`); with
`MESHTX_REQUIRE_BROWSER=1` (set by .ci/run) a missing Chromium fails instead.

Screenshots (and, on a failure, the page and Voila's log) go to `$MESHTX_ARTIFACTS` or `tests/artifacts/`."""
import contextlib, os, re, shutil, time
import pytest
from browser_util import (CHROMIUM_ARGS, artifacts_dir, chromium_path, image_src, page_errors, set_widget_value, tail,
                          voila_server, wait_for_widget, wait_until, widget_text, write_notebook)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PAGE_TIMEOUT = 90   # s: Voila runs the whole notebook (JAX import, model init) before the page shows
COMPILE_TIMEOUT = 60   # s: the kernel's first JAX compile of a step or of generation, on 2 busy cores


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
    """Factory: serve a notebook made of `cells` with Voila; yields (url, log path). Voila and its kernel are always
    ended at teardown. (Depends on `browser` so that nothing starts where the test would be skipped.)"""
    with contextlib.ExitStack() as stack:
        def serve(*cells, name="nb"):
            nb = write_notebook(tmp_path / f"{name}.ipynb", *cells)
            return stack.enter_context(voila_server(nb, timeout=60))
        yield serve


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1100, "height": 900})
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


def test_sampler_widget_in_browser(voila, page):
    url, log = voila("from meshtx import LM\nimport meshtx.widgets as W\nlm = LM.init('demo')",
                     "W.SamplerWidget(lm)", name="sampler")
    out = artifacts_dir("sampler")
    with diagnosed(page, log, "sampler"):
        wait_for_widget(page, url, ".meshtx-prompt", PAGE_TIMEOUT)
        for cls in ("generate", "stop", "output", "stats", "error", "temperature", "top-p", "top-k", "max-tokens",
                    "repetition-penalty", "seed"):
            assert page.locator(f".meshtx-{cls}").count() == 1, f"no element with class meshtx-{cls}"
        assert page.locator(".meshtx-stop").is_disabled(), "Stop is enabled before generating"
        set_widget_value(page, "meshtx-prompt", "Once upon a time")
        set_widget_value(page, "meshtx-max-tokens", 400)   # long enough to watch it stream and stop it
        assert widget_text(page, "meshtx-max-tokens") == "400"
        page.screenshot(path=str(out / "1-ready.png"))
        page.click(".meshtx-generate")
        # streaming: the output grows in several steps while the generation runs (the first generation compiles the
        # decoding loop after the first piece: a pause of a second or more, then pieces every ~0.1 s)
        n1 = len(wait_until(lambda: widget_text(page, "meshtx-output"), COMPILE_TIMEOUT, msg="the first tokens"))
        seen = [n1]
        def grew_twice():
            n = len(widget_text(page, "meshtx-output"))
            if n != seen[-1]: seen.append(n)
            return len(seen) >= 3
        wait_until(grew_twice, COMPILE_TIMEOUT, interval=0.05, msg="the output to grow twice while streaming")
        assert seen == sorted(seen), f"the output shrank while streaming: {seen} characters"
        n3 = seen[-1]
        page.screenshot(path=str(out / "2-streaming.png"))
        assert page.locator(".meshtx-stop").is_enabled(), "Stop is disabled while generating"
        page.click(".meshtx-stop")
        # stopped: Generate comes back, the output stays as it is, the stats show the speed
        page.wait_for_selector(".meshtx-generate:not([disabled])", timeout=30_000)
        m1 = widget_text(page, "meshtx-output")
        time.sleep(1.0)
        m2 = widget_text(page, "meshtx-output")
        assert m1 == m2, f"the output kept growing after Stop: {len(m1)} -> {len(m2)} characters"
        assert len(m1) >= n3
        stats = widget_text(page, "meshtx-stats")
        assert re.search(r"time to first token", stats) and re.search(r"[\d.]+ tokens/s", stats), stats
        n_tokens = int(re.search(r"(\d+) tokens\b(?!/)", stats).group(1))
        assert n_tokens < 400, f"Stop did not stop the generation early: {stats}"
        assert page.locator(".meshtx-stop").is_disabled()
        assert not widget_text(page, "meshtx-error").strip(), widget_text(page, "meshtx-error")
        page.screenshot(path=str(out / "3-stopped.png"))


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


def test_finetune_widget_in_browser(voila, page):
    url, log = voila(FINETUNE_SETUP, "W.FinetuneWidget(t)", name="finetune")
    out = artifacts_dir("finetune")
    with diagnosed(page, log, "finetune"):
        wait_for_widget(page, url, ".meshtx-step", PAGE_TIMEOUT)
        for cls in ("start", "pause", "save", "progress", "status", "plot", "sample"):
            assert page.locator(f".meshtx-{cls}").count() == 1, f"no element with class meshtx-{cls}"
        assert _step(page) == 0, widget_text(page, "meshtx-status")
        page.screenshot(path=str(out / "1-ready.png"))
        # one step by hand (the first compiles the train step)
        page.click(".meshtx-step")
        wait_until(lambda: _step(page) == 1, COMPILE_TIMEOUT, msg="'step 1' after Step")
        src1 = wait_until(lambda: image_src(page, "meshtx-plot"), 10, msg="the plot after step 1")
        page.screenshot(path=str(out / "2-one-step.png"))
        # background training: the counter advances, the plot is redrawn
        page.click(".meshtx-start")
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
        progress = page.evaluate("() => document.querySelector('.meshtx-progress .progress-bar')?.style.width")
        assert progress and progress != "0%", f"progress bar width {progress!r}"
        assert not widget_text(page, "meshtx-error").strip(), widget_text(page, "meshtx-error")
        page.screenshot(path=str(out / "3-paused.png"), full_page=True)
