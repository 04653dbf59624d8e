"""`bench/scale.py` runs end to end (as a smoke test, at a tiny width): it writes its checkpoints, runs every row in its
own processes and prints one table with every row in it. No timing or target is asserted: a row whose meshtx side
fails is reported in the table (that is what the benchmark is for), not a crash."""
import json, os, subprocess, sys
from pathlib import Path
import pytest

SCALE = Path(__file__).parent.parent / "bench" / "scale.py"
ROWS = ["load", "convert", "logits", "generate", "decode1", "prefill", "decode16", "slots", "lora128", "lora512", "train", "plan", "bin"]


@pytest.mark.slow
def test_scale_prints_every_row(tmp_path):
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, str(SCALE), "--layers", "1", "--d-model", "256", "--n-head", "4", "--vocab", "1024",
                        "--repeats", "1", "--new", "8", "--max-rss", "4", "--timeout", "120", "--cache", str(tmp_path / "cache"),
                        "--json", str(out)], capture_output=True, text=True, timeout=480)   # ~24 processes, each importing JAX or torch
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    start = lines.index("| row | figure | meshtx | HF | ratio | target | met? | note |")
    table = [l for l in lines[start + 2:] if l.startswith("| ")]
    table = table[:next((i for i, l in enumerate(table) if l.startswith("| row | side |")), len(table))]
    rows = {l.split("|")[1].strip() for l in table}
    assert rows == set(ROWS), (sorted(rows), r.stdout[-3000:])
    assert "| row | side | process | exit | wall s | peak RSS GB (self) |" in r.stdout
    # the slots row ran whole: its token check, against generate's top-2 gaps where the two differ, is in the table
    assert any(l.startswith("| slots | greedy tokens equal generate's | ") and "/16 requests" in l for l in table), r.stdout[-3000:]
    # the checkpoint was written once, whole (no temporary left), in both forms, with its index and config
    cache = tmp_path / "cache"
    assert sorted(p.name for p in cache.iterdir()) == ["gptj-d256-f1024-h4-v1024-L1-fp16-bin", "gptj-d256-f1024-h4-v1024-L1-fp16-safetensors"]
    st = cache / "gptj-d256-f1024-h4-v1024-L1-fp16-safetensors"
    index = json.loads((st / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and json.loads((st / "config.json").read_text())["dtype"] == "float16"
    # HF's side ran (its reference is what meshtx's parity figures compare against), and the JSON lines were written
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    procs = [x for x in recs if x["bench"] == "scale-process"]
    assert all(p["exit"] == 0 for p in procs if p["side"] == "hf"), [p for p in procs if p["side"] == "hf" and p["exit"]]
    assert {x["row"] for x in recs if x["bench"] == "scale"} == set(ROWS)
