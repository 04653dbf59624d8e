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


@pytest.mark.slow
def test_tpu_script_runs_on_the_cpu(tmp_path):
    """bench/tpu.py, the lent TPU chip's plan, at the tiny shape on the CPU: the parity run (here CPU against CPU, in two
    processes), each kind of row, and the plan rows all finish and write their JSON lines. No timing is asserted."""
    import json
    out, env = tmp_path / "rows.jsonl", {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    runs = [["parity", "--quick", "--variants", "qwen2 window on the last layer"], ["row", "tiny", "infer", "--prompt", "16", "--new", "8", "--batch", "2"],
            ["row", "tiny", "lora", "--seq", "32"], ["row", "tiny", "train", "--seq", "32"], ["plan", "tiny", "--seq", "16", "--batch", "2"],
            ["infer-plan", "tiny", "--shapes", "2x8x32"], ["loss", "tiny", "--seq", "32"]]
    r = subprocess.run([sys.executable, str(BENCH / "tpu.py"), *runs[0], "--json", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=BENCH, env=env)   # the parity run: its own process, which starts the reference's
    assert r.returncode == 0, (runs[0], r.stderr[-3000:])
    rest = [[*args, "--json", str(out)] for args in runs[1:]]   # the others one after another in one process (`main`)
    r = subprocess.run([sys.executable, "-c", f"import tpu\nfor argv in {rest!r}: tpu.main(argv)"], capture_output=True,
                       text=True, timeout=400, cwd=BENCH, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["row"] for r in rows] == ["parity", "infer", "lora", "train", "plan", "plan", "infer_plan", "loss", "loss"], rows
    assert rows[0]["ok"] and rows[0]["logits_max_abs"] == 0   # the CPU against itself: exactly equal
    assert rows[1]["batch2"]["tokens_per_s"] > 0 and rows[1]["batch1"]["plan_gib"] > 0
    assert all(r["loss"] > 0 for r in rows[2:4]) and all(0.5 < r["plan_over_xla"] < 2 for r in rows[4:6])
    assert rows[6]["xla_gib"] > 0 and rows[6]["plan_gib"] > 0   # on a CPU the stacked weights are converted whole: no ratio asserted
    assert all(r["batch"] == 2 for r in rows[4:6])
    for r in rows[7:]:   # the vocabulary's share, and the loss alone in chunks (a full step's includes the head's gradient)
        assert r["full"]["xla_gib"] > r["half"]["xla_gib"] > 0 and r["loss_program_temporaries_in_chunks"] >= 0, r


@pytest.mark.slow
def test_products_benchmark_prints_its_table(tmp_path):
    """bench/products.py: one of GPT-J-6B's products at 2 rows, meshtx's and torch's, then meshtx's two CPU forms
    (`--forms`); a table row each and a JSON line (no timing asserted)."""
    import json
    r = subprocess.run([sys.executable, str(BENCH / "products.py"), "--rows", "2", "--repeats", "1", "--products", "out",
                        "--json", str(tmp_path / "p.jsonl"), "--forms"], capture_output=True, text=True, timeout=300, cwd=BENCH)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l for l in r.stdout.splitlines() if l.startswith("| `out` [4096, 4096] | 2 |")]
    assert all(float(x) > 0 for x in rows[0].split("|")[3:7]), r.stdout
    assert len(rows) == 2 and all(float(x) > 0 for x in rows[1].split("|")[3:7]), r.stdout   # --forms: both of them
    (row,) = [json.loads(l) for l in open(tmp_path / "p.jsonl")]
    assert row["product"] == "out" and row["rows"] == 2 and row["meshtx_ms"] > 0 and row["torch_ms"] > 0


def test_tpu_steps_reads_every_recorded_tpu_point():
    """`bench/tpu_steps.py tables` compiles again every TPU step tests/test_sharding.py holds (after a model change, on a
    TPU host or anywhere libtpu is). It reads them from that file's source: all four tables, every field in place."""
    sys.path.insert(0, str(BENCH))
    try:
        import tpu_steps
    finally:
        sys.path.remove(str(BENCH))
    import test_sharding as t
    pts = tpu_steps.recorded_points()
    tables = {"TPU_V5E_STEPS": t.TPU_V5E_STEPS, "TPU_V5E_FULL_STEPS": t.TPU_V5E_FULL_STEPS,
              "TPU_V5E_LORA_MESH_STEPS": t.TPU_V5E_LORA_MESH_STEPS, "TPU_V5E8_COMPILED_HERE": t.TPU_V5E8_COMPILED_HERE}
    assert [p[0] for p in pts] == [name for name, rows in tables.items() for _ in rows]
    assert [p[-1] for p in pts] == [row[-1] for rows in tables.values() for row in rows]   # the recorded GiB
    for table, name, layers, mode, dtype, B, T, dp, fsdp, mp, gib in pts:
        assert mode in ("train", "lora") and dtype in ("bfloat16", "float32") and dp * fsdp * mp in (1, 8), (table, name)
    assert ("TPU_V5E_FULL_STEPS", "gptj-6b", 4, "train", "bfloat16", 1, 256, 1, 1, 1, 9.537) in pts
    assert ("TPU_V5E_LORA_MESH_STEPS", "gptj-6b", None, "lora", "bfloat16", 8, 2048, 1, 2, 4, 5.323) in pts


def test_xla_peak_names_the_buffers_at_a_programs_peak(tmp_path):
    """`bench/xla_peak.py` reads XLA's dump of a program (buffer assignment, live ranges, optimized HLO) and says which
    buffers are live at its peak, phase by phase. Here XLA:CPU's dump of a program whose one large temporary is known:
    `tanh(x @ xᵀ)` is 1024 × 1024 float32 (4 MiB) and must exist whole before it multiplies `x` again."""
    code = ("import jax, jax.numpy as jnp\n"
            "def step(x): return jnp.tanh(x @ x.T) @ x\n"
            "jax.jit(step)(jnp.ones((1024, 64), jnp.float32)).block_until_ready()\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={tmp_path}"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    out = subprocess.run([sys.executable, str(BENCH / "xla_peak.py"), str(tmp_path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    peak = float(out.split("live peak ")[1].split(" GiB")[0])
    # the product, and the output (0.25 MiB): tanh writes in place (two values in one slot count once, not 8 MiB)
    assert 4 / 1024 <= peak < 5 / 1024, out
    assert any("4.0 MiB" in line and "f32[1024,1024]" in line for line in out.splitlines()), out
