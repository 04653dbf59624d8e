"""Helpers for the real-browser widget tests: a notebook served by Voila on 127.0.0.1, Debian's Chromium via Playwright.

Nothing here downloads anything: Chromium comes from the system (`apt-get install chromium`), Playwright is used
only as a driver (never `playwright install`)."""
import contextlib, os, re, shutil, signal, socket, subprocess, sys, time, urllib.error, urllib.request
from pathlib import Path

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def chromium_path():
    "The system Chromium (Debian's `chromium`), or None."
    return shutil.which("chromium") or shutil.which("chromium-browser")


def artifacts_dir(name=None) -> Path:
    "Where screenshots and logs go: `$MESHTX_ARTIFACTS` or `tests/artifacts/` (gitignored); a sub-folder `name`."
    d = Path(os.environ.get("MESHTX_ARTIFACTS") or Path(__file__).parent / "artifacts")
    if name: d = d / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def write_notebook(path, *sources) -> Path:
    "A notebook at `path` with one code cell per source string (Python 3 kernel)."
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    path = Path(path)
    nbformat.write(nb, str(path))
    return path


def kernel_env():
    """The environment for Voila and its kernel: offline, CPU-only JAX with a single device (the tests' 8 simulated
    devices are for the sharding tests; a notebook user has one), other XLA flags kept."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _voila_cmd(nb, port):
    exe = shutil.which("voila", path=str(Path(sys.executable).parent)) or shutil.which("voila")
    head = [exe] if exe else [sys.executable, "-m", "voila"]
    return head + [nb.name, "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1", "--Voila.token=",
                   "--show_tracebacks=True", "--Voila.log_level=WARN",
                   # a cell error shows on the page rather than as a blank one
                   "--VoilaConfiguration.progressive_rendering=False",
                   "--Voila.tornado_settings", "autoreload=False"]


def ipywidgets771_env():
    """The environment additions that make Voila and its kernel use ipywidgets 7.7.1 (Colab's) from the overlay that
    tools/test.sh installs (`$MESHTX_IPYW771_DIR` or ~/.cache/meshtx/ipyw771), or None where it is not installed.
    JUPYTER_PATH makes Voila pick its ipywidgets-7 widget manager (it goes by the installed jupyterlab-manager)."""
    d = Path(os.environ.get("MESHTX_IPYW771_DIR") or Path.home() / ".cache/meshtx/ipyw771")
    version = d / "ipywidgets/_version.py"
    if not version.is_file() or "7, 7, 1" not in version.read_text(): return None
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")])),
            "JUPYTER_PATH": os.pathsep.join(filter(None, [str(d / "share/jupyter"), os.environ.get("JUPYTER_PATH")]))}


@contextlib.contextmanager
def voila_server(nb_path, timeout=60, log_path=None, env=None):
    """Serve `nb_path` with Voila on a free port on 127.0.0.1 (`env`: variables to add); yields (url, log_path).

    Voila runs in its own process group so that it and its kernel are always ended together."""
    nb_path = Path(nb_path)
    port = free_port()
    log_path = Path(log_path or nb_path.with_suffix(".voila.log"))
    log = open(log_path, "wb")
    proc = subprocess.Popen(_voila_cmd(nb_path, port), cwd=nb_path.parent, env={**kernel_env(), **(env or {})}, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + timeout
        while True:   # any HTTP answer from a cheap path means the server is up (GET / would run the notebook)
            try:
                urllib.request.urlopen(url + "voila/static/nonexistent", timeout=2); break
            except urllib.error.HTTPError:
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"voila exited with {proc.returncode}:\n{tail(log_path)}")
                if time.time() > deadline:
                    raise RuntimeError(f"voila did not answer within {timeout} s:\n{tail(log_path)}")
                time.sleep(0.25)
        yield url, log_path
    finally:
        _stop_group(proc)
        log.close()


def _stop_group(proc, grace=5):
    "SIGTERM Voila's process group (Voila shuts its kernel down), then SIGKILL whatever is left of it."
    try: os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError: pass
    try: proc.wait(grace)
    except subprocess.TimeoutExpired: pass
    try: os.killpg(proc.pid, signal.SIGKILL)   # the kernel too, if it outlived Voila
    except ProcessLookupError: pass
    proc.wait()


def tail(path, n=4000):
    try: return Path(path).read_text(errors="replace")[-n:]
    except OSError: return ""


def wait_until(fn, timeout, interval=0.2, msg="condition"):
    "Poll `fn()` until it returns a truthy value (returned); AssertionError after `timeout` s."
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v: return v
        if time.time() > deadline: raise AssertionError(f"timed out after {timeout} s waiting for {msg}")
        time.sleep(interval)


# --- reading ipywidgets from the page ------------------------------------------------------------------------------

def widget_text(page, cls):
    """The visible text of the widget with CSS class `cls`: the value of a Textarea/Text/number input inside it, else
    its inner text."""
    return page.evaluate("""cls => {
        const el = document.querySelector('.' + cls);
        if (!el) return null;
        const inp = el.matches('textarea, input') ? el : el.querySelector('textarea, input');
        return inp ? inp.value : el.innerText;
    }""", cls)


def set_widget_value(page, cls, value):
    "Type `value` into the input/textarea of the widget with class `cls` and commit it (as a user would: fill, Enter/blur)."
    loc = page.locator(f".{cls} textarea, .{cls} input, textarea.{cls}, input.{cls}").first
    loc.fill(str(value))
    if loc.evaluate("e => e.tagName") == "INPUT": loc.press("Enter")
    loc.blur()


def image_src(page, cls):
    "The `src` of the <img> of an ipywidgets Image with class `cls` (a blob: URL that changes when the bytes change)."
    return page.evaluate("""cls => {
        const el = document.querySelector('.' + cls);
        if (!el) return null;
        const img = el.tagName === 'IMG' ? el : el.querySelector('img');
        return img ? img.getAttribute('src') : null;
    }""", cls)


_STDERR = '[data-mime-type="application/vnd.jupyter.stderr"], [data-mime-type="application/vnd.jupyter.error"]'


def page_errors(page):
    "The text of the notebook's stderr outputs on the page (a failing cell's traceback, warnings)."
    return page.evaluate("sel => Array.from(document.querySelectorAll(sel)).map(e => e.innerText).join('\\n')", _STDERR)


def wait_for_widget(page, url, selector, timeout):
    """Open Voila's page and wait until `selector` is visible; fail at once, with the traceback, if a cell raised."""
    page.goto(url, timeout=timeout * 1000, wait_until="domcontentloaded")
    page.wait_for_function("""([sel, err]) => {
        const el = document.querySelector(sel);
        if (el && el.offsetParent !== null) return true;
        return Array.from(document.querySelectorAll(err)).some(e => /Traceback|Error/.test(e.innerText));
    }""", arg=[selector, _STDERR], timeout=timeout * 1000, polling=250)
    if not page.locator(selector).count():
        raise AssertionError(f"a notebook cell failed; {selector} never appeared:\n{page_errors(page)}")


def truncated_labels(page):
    """The text of every visible label, slider readout or HTML line whose text is cut (wider than its box: an ellipsis
    or hidden overflow)."""
    return page.evaluate("""() => Array.from(document.querySelectorAll(
            '.widget-label, .widget-label-basic, .widget-readout, .widget-html-content, .widget-checkbox label, button'))
        .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)""")


def overflowing(page):
    """Widgets whose right edge is past the page's (or past the output area they sit in): 'class right>limit'."""
    return page.evaluate("""() => {
        const limit = Math.min(window.innerWidth, document.documentElement.clientWidth);
        return Array.from(document.querySelectorAll('.jupyter-widgets, .widget-box, input, textarea, pre'))
            .filter(e => e.offsetParent !== null).flatMap(e => {
                const area = e.closest('.jp-OutputArea-output, .output_subarea');
                const right = Math.min(limit, area ? area.getBoundingClientRect().right : limit);
                const r = e.getBoundingClientRect().right;
                return r > right + 0.5 ? [`${e.className} ${r}>${right}`] : [];
            });
    }""")


def shoot(page, path, copy_to=None):
    "A full-page screenshot at `path`, copied into the folder `copy_to` too if given."
    page.screenshot(path=str(path), full_page=True)
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(copy_to) / Path(path).name)
