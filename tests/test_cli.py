"""The `meshtx` console script, run as a user runs it: a real process."""
import os, subprocess, sys, shutil
from pathlib import Path
import numpy as np
from meshtx import LM

def meshtx(*args, timeout=300):
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_info():
    r = meshtx("info")
    assert r.returncode == 0, r.stderr
    lines = dict(l.split(None, 1) for l in r.stdout.strip().splitlines())
    assert lines["backend"] == "cpu"
    assert lines["version.jax"][0].isdigit() and lines["version.meshtx"][0].isdigit()
    assert lines["compilation_cache"] == os.environ["MESHTX_CACHE_DIR"]   # the CLI turns the cache on


def test_convert_round_trip_in_bf16(tmp_path):
    lm = LM.init("tiny")
    lm.save_hf(tmp_path / "hf", progress=False)
    r = meshtx("convert", tmp_path / "hf", tmp_path / "mtx", "--dtype", "bfloat16", "-q")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mtx" / "meshtx_config.json").exists()
    r = meshtx("convert", tmp_path / "mtx", tmp_path / "hf2", "-q")
    assert r.returncode == 0, r.stderr
    back = LM.from_hf(tmp_path / "hf2", dtype="float32", progress=False)
    ref = np.asarray(lm.params["gptj/blocks/mlp/fc_in"]["w"])
    got = np.asarray(back.params["gptj/blocks/mlp/fc_in"]["w"])
    np.testing.assert_array_equal(got, ref.astype("bfloat16").astype(np.float32))   # exactly a bf16 rounding


def test_errors_are_one_line_not_tracebacks(tmp_path):
    r = meshtx("convert", tmp_path / "missing", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr.startswith("meshtx: error:") and "is not a checkpoint directory" in r.stderr
    assert "Traceback" not in r.stderr
    r = meshtx("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_sample_streams_the_greedy_continuation():
    from meshtx import sampling  # noqa: F401  (adds LM.generate)
    want = LM.init("demo").generate("Once upon a time", max_new_tokens=12, temperature=0).texts[0]
    r = meshtx("sample", "--preset", "demo", "--prompt", "Once upon a time", "--temperature", "0",
               "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Once upon a time" + want + "\n"
    r = meshtx("sample", "--preset", "demo", "--top-p", "3", "--prompt", "x")
    assert r.returncode == 2 and "invalid top_p=3.0" in r.stderr


def test_sigterm_during_prepare_data_leaves_no_staging_folder(tmp_path):
    "A scheduler's SIGTERM unwinds like Ctrl-C: exit status 143, and the hidden staging folder beside --out is gone."
    import signal, time
    (tmp_path / "big.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400_000)   # ~18 MB: seconds to tokenize
    p = subprocess.Popen([str(Path(sys.executable).parent / "meshtx"), "prepare-data", str(tmp_path / "big.txt"),
                          "--out", str(tmp_path / "data"), "--tokenizer", "gpt2", "--seq", "64"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".meshtx-data-*/tokens.bin")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, "prepare-data finished before it could be stopped: give it more text"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-2000:])
    assert not list(tmp_path.glob(".meshtx-data-*")) and not (tmp_path / "data").exists()
