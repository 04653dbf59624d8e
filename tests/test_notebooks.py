"""The library notebooks read as lessons on GitHub: small exported cells, examples whose outputs are kept, and outputs
that are short and the same on every machine (no temporary paths, memory addresses or tracebacks; timings are
masked by the examples themselves, which no pattern can tell from a fixed figure)."""
import json, re, statistics
from pathlib import Path
import pytest

NBS = Path(__file__).parent.parent / "nbs"
LIBRARY = sorted(NBS.glob("[0-9]*.ipynb"))
MACHINE = re.compile(r"/tmp/|/private/var/| at 0x[0-9a-f]+|Traceback \(most recent call last\)")   # temporary paths, addresses, tracebacks


def _cells(nb):
    return [("".join(c["source"]), c) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]


def _text(o) -> str:
    if o["output_type"] == "stream": return "".join(o["text"])
    return "".join(o.get("data", {}).get("text/plain", ""))


@pytest.mark.parametrize("nb", LIBRARY, ids=lambda p: p.stem)
def test_examples_keep_short_deterministic_outputs(nb):
    cells = _cells(nb)
    examples = [c for s, c in cells if not s.lstrip().startswith("#|")]
    kept = [c for c in examples if c.get("outputs")]
    assert kept, f"{nb.name}: none of its {len(examples)} example cells keeps an output (run tools/keep_outputs.py)"
    for c in kept:
        for o in c["outputs"]:
            assert o["output_type"] != "error" and not (o["output_type"] == "stream" and o["name"] == "stderr"), nb.name
            text = _text(o)
            assert len(text.splitlines()) <= 60, f"{nb.name}: an output of {len(text.splitlines())} lines"
            assert not MACHINE.search(text), f"{nb.name}: a machine-dependent output: {MACHINE.search(text)[0]!r}"
    for s, c in cells:
        if s.lstrip().startswith("#| export"): assert not c.get("outputs"), f"{nb.name}: an exported cell keeps an output"


def test_exported_cells_are_the_size_of_their_prose():
    sizes = [len(s.splitlines()) for nb in LIBRARY for s, _ in _cells(nb) if s.lstrip().startswith("#| export")]
    # nbdev's own notebooks (fastcore, execnb, claudette): a median of 6-10 lines; ours were 28 with cells of 242 lines
    assert statistics.median(sizes) <= 16, statistics.median(sizes)
    assert max(sizes) <= 50, max(sizes)


def test_each_name_means_one_thing():
    "`meshtx.train` is the module `08_train` exports; whole runs are `meshtx.runs.train`; bench/ shapes are meshtx's presets."
    import sys, types, inspect, meshtx
    from meshtx.config import PRESETS
    from meshtx.runs import train
    assert isinstance(meshtx.train, types.ModuleType) and meshtx.train is sys.modules["meshtx.train"]
    assert callable(train) and hasattr(meshtx.train, "Trainer")
    sys.path.insert(0, str(NBS.parent / "bench"))
    try:
        import common
        assert common.PRESETS is PRESETS
    finally: sys.path.remove(str(NBS.parent / "bench"))
    assert "steps_per_call" in inspect.signature(meshtx.LM.generate).parameters
    assert "chunk" not in inspect.signature(meshtx.LM.generate).parameters
