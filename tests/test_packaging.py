"""`pip install meshtx`: the wheel builds, and installs and imports in a fresh environment."""
import os, subprocess, sys, sysconfig, zipfile
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
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "meshtx = meshtx.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()

    # a fresh venv: the wheel installed without its dependencies, which come from this environment's
    # site-packages on PYTHONPATH (so the test needs no download); the repo's meshtx/ is not importable
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    py, exe = venv / "bin" / "python", venv / "bin" / "meshtx"
    r = subprocess.run([py, "-m", "pip", "install", "--no-deps", "-q", wheel], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    code = ("import meshtx, sys; from meshtx import LM; "
            "print(meshtx.__file__); print(LM.init('tiny').logits([1, 2, 3]).shape)")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    where, shape = r.stdout.strip().splitlines()[-2:]
    assert Path(where).is_relative_to(venv), where
    assert shape == "(1, 3, 1024)"
    r = subprocess.run([exe, "info"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and "backend" in r.stdout, r.stderr
