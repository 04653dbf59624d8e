"""Run library notebooks and keep their examples' outputs, so a reader on GitHub sees what each definition does.

    python tools/keep_outputs.py nbs/00_config.ipynb ...   # default: every library notebook (nbs/[0-9]*.ipynb)

Each notebook runs as `nbdev-test` runs it (cells flagged `heavy`/`notest` are skipped; 8 simulated CPU devices and
offline, as in `tools/test.sh`). Only what a reader can use is kept: stdout and results as text (and PNG plots),
never stderr (warnings, progress bars: they differ between machines), never widget state. Sources are not touched:
the outputs are copied into the notebook cell by cell, and a cell whose source changed meanwhile keeps none.
Each notebook is then cleaned as `nbdev-clean` does (outputs stay; execution counts and metadata go)."""
import json, os, re, sys, shutil
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
KEEP = ("text/plain", "text/markdown", "text/html", "image/png")
MAX_LINES = 40


def _text(x): return "".join(x) if isinstance(x, list) else x


def kept(outputs: list) -> list:
    "The outputs worth keeping: stdout streams, results and displays (text, markdown, html, png), errors never."
    out = []
    for o in outputs:
        if o.get("output_type") == "stream" and o.get("name") == "stdout":
            out.append({"output_type": "stream", "name": "stdout", "text": ANSI.sub("", _text(o["text"]))})
        elif o.get("output_type") in ("execute_result", "display_data"):
            data = {k: v for k, v in o.get("data", {}).items() if k in KEEP}
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {}): data.pop("text/html", None)
            if not data: continue
            d = {"output_type": o["output_type"], "metadata": {}, "data": data}
            if o["output_type"] == "execute_result": d["execution_count"] = None
            out.append(d)
    # one stdout stream per run of consecutive prints
    merged = []
    for o in out:
        if merged and o["output_type"] == "stream" and merged[-1]["output_type"] == "stream": merged[-1]["text"] += o["text"]
        else: merged.append(o)
    for o in merged:
        if o["output_type"] == "stream": o["text"] = o["text"].splitlines(keepends=True)
        else:
            for k, v in o["data"].items():
                if k != "image/png": o["data"][k] = _text(v).splitlines(keepends=True)
    return merged


def run(fn: Path) -> list[str]:
    "Execute `fn` (a copy, in its own folder) and copy the kept outputs into it; returns warnings about long outputs."
    from nbdev.test import test_nb
    tmp = fn.parent / f".{fn.stem}.keep-outputs.ipynb"   # same folder: relative paths in the notebook still work
    shutil.copy(fn, tmp)
    try:
        ok, _ = test_nb(tmp, skip_flags=["notest", "heavy"], save=True)
        if not ok: raise SystemExit(f"{fn}: a cell failed (see above); outputs not kept")
        ran = json.loads(tmp.read_text())
    finally: tmp.unlink(missing_ok=True)
    src = json.loads(fn.read_text())   # read again now: an edit made while it ran is kept (its cell keeps no output)
    by_source = {}
    for c in ran["cells"]:
        if c["cell_type"] == "code": by_source.setdefault(_text(c["source"]), []).append(c.get("outputs", []))
    notes = []
    for c in src["cells"]:
        if c["cell_type"] != "code": continue
        runs = by_source.get(_text(c["source"]).strip("\n"), []) or by_source.get(_text(c["source"]), [])
        outs = kept(runs.pop(0)) if runs else []
        if _text(c["source"]).lstrip().startswith("#| export"): outs = []   # definitions print nothing worth keeping
        c["outputs"] = outs
        n = sum(len(o.get("text", [])) + sum(len(v) for k, v in o.get("data", {}).items() if k != "image/png") for o in outs)
        if n > MAX_LINES: notes.append(f"{fn.name}: a cell keeps {n} lines of output ({_text(c['source'])[:60]!r}…)")
        c["execution_count"] = None
    fn.write_text(json.dumps(src, indent=1, ensure_ascii=False) + "\n")
    from nbdev.clean import nbdev_clean
    nbdev_clean(str(fn))   # nbdev's form (it keeps outputs): what CI's agreement check expects
    return notes


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    files = [Path(a).resolve() for a in sys.argv[1:]] or sorted((root / "nbs").glob("[0-9]*.ipynb"))
    notes = []
    for f in files:
        print("running", f.name, flush=True)
        notes += run(f)
    print("\n".join(notes) or "every kept output is short")
