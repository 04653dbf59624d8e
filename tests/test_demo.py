"""`meshtx demo`, the README's main job: offline, from scratch, to <= 1.5 nats/byte on held-out text."""
import os, subprocess, sys, re, time
from pathlib import Path
import pytest


@pytest.mark.slow
def test_demo_learns(tmp_path):
    # as a user runs it: one CPU device, and XLA's full optimizations (tools/test.sh turns most off to compile faster;
    # this test is mostly running the compiled steps, which then take over twice as long)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    exe = Path(sys.executable).parent / "meshtx"
    t0 = time.monotonic()
    r = subprocess.run([str(exe), "demo", "--out", str(tmp_path / "demo"), "-q"], capture_output=True, text=True,
                       timeout=900, env=env)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    before = float(re.search(r"before training: ([\d.]+) nats/byte", r.stdout)[1])
    after = float(re.search(r"after training: ([\d.]+) nats/byte", r.stdout)[1])
    print(f"demo: {before:.3f} -> {after:.3f} nats/byte in {elapsed:.0f} s")
    assert before > 5.3 and after <= 1.5, (before, after)
    assert "samples before training" in r.stdout and "samples after training" in r.stdout
    assert (tmp_path / "demo" / "loss.png").stat().st_size > 10_000
    assert (tmp_path / "demo" / "checkpoint" / "params.safetensors").exists()
