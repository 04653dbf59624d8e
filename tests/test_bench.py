"""The benchmarks run (as a smoke test, at the tiny shape): each finishes and prints its table. No timing is asserted."""
import os, subprocess, sys
from pathlib import Path
import pytest

BENCH = Path(__file__).parent.parent / "bench"
ARGS = {"decode": ["--prompt", "8", "--new", "8", "--batch", "2", "--profile", "--compare-cache-reads"], "prefill": ["--seq", "32", "--batch", "2"],
        "train": ["--seq", "32", "--batch", "2"], "lora": ["--seq", "32", "--batch", "2"], "compile": [], "compile-abstract": ["--abstract", "--seq", "32"],
        "memory": ["--seq", "32"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ARGS))
def test_benchmark_prints_its_table(name):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    r = subprocess.run([sys.executable, str(BENCH / f"{name.split('-')[0]}.py"), "--preset", "tiny", "--repeats", "1", *ARGS[name]],
                       capture_output=True, text=True, timeout=300, cwd=BENCH, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    table = [l for l in r.stdout.splitlines() if l.startswith("| ")]
    header, rows = table[0], table[1:]
    assert header.startswith("| figure | meshtx | HF transformers | ratio |") and rows, r.stdout
    if name == "decode":
        assert "Costliest ops of one batch-1 generation" in r.stdout and "| op | total ms | count |" in r.stdout, r.stdout
        assert any(l.startswith("| `") for l in r.stdout.splitlines()), r.stdout   # at least one op was traced
        assert "(traced call: " in r.stdout, r.stdout
        # the other way of reading the cache ("all": on a CPU, "auto" reads the filled chunks), meshtx only
        assert sum("cache_read='all'" in l for l in rows) == 2, r.stdout
        rows = [l for l in rows if "cache_read=" not in l]
    if not name.startswith("compile"):
        assert all("—" not in l.split("|")[3] for l in rows if "tok/s" in l), r.stdout   # HF measured too


@pytest.mark.slow
def test_serve_benchmark_prints_its_table():
    "bench/serve.py: a tiny server on 127.0.0.1, two clients for 3 s; the table has a row per figure (no timing asserted)."
    r = subprocess.run([sys.executable, str(BENCH / "serve.py"), "--preset", "tiny", "--clients", "2", "--seconds", "3"],
                       capture_output=True, text=True, timeout=600, cwd=BENCH)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    table = [l for l in r.stdout.splitlines() if l.startswith("| ")]
    assert table[0].startswith("| figure | ") and len(table) > 10, r.stdout
    rows = {l.split(" | ")[0][2:]: l.split(" | ")[1] for l in table[1:]}
    assert int(rows["requests answered (of them streamed)"].split()[0]) > 0, r.stdout
    assert any(k.startswith("head of line") for k in rows) and "server RSS idle (after warm-up) / peak (VmHWM)" in rows, r.stdout
