"""`pip install meshtx`: the wheel builds, and installs and imports in a fresh environment."""
import os, subprocess, sys, zipfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_builds_installs_and_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", ROOT],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("meshtx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "meshtx/lm.py" in names and "meshtx/model.py" in names
    assert not any(n.startswith(("nbs/", "tests/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names   # the Apache-2.0 text travels
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "meshtx = meshtx.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()

    # a fresh venv with nothing but the wheel and the dependencies it declares (from the package index),
    # run from outside the repository: a missing dependency or a file left out of the wheel fails here
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    py, exe = venv / "bin" / "python", venv / "bin" / "meshtx"
    r = subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["MESHTX_CACHE_DIR"] = "off"
    code = ("import meshtx, sys; from meshtx import LM; "
            "print(meshtx.__file__); print('torch' in sys.modules); "
            "print(LM.init('demo').generate('Hello', max_new_tokens=3, temperature=0).tokens[0].__len__())")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    where, torch_loaded, n = r.stdout.strip().splitlines()[-3:]
    assert Path(where).is_relative_to(venv), where
    assert torch_loaded == "False" and n == "3"            # torch stays optional
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("meshtx "), r.stdout + r.stderr
    r = subprocess.run([py, "-m", "meshtx", "--version"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("meshtx "), r.stdout + r.stderr   # where the script is not on PATH
    r = subprocess.run([exe, "info"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and "backend" in r.stdout, r.stderr
    r = subprocess.run([exe, "demo", "--steps", "10", "--out", tmp_path / "demo", "-q"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0 and (tmp_path / "demo" / "loss.png").exists(), r.stdout[-2000:] + r.stderr[-2000:]
