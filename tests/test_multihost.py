"""Two real processes x 4 CPU devices, joined through jax.distributed on 127.0.0.1, train like one process with 8."""
import json, os, socket, subprocess, sys, time
from pathlib import Path
import pytest

pytestmark = pytest.mark.compat   # also run under jax==0.7.2

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def run_job(nproc, out, deadline=60, env_extra=None):
    "Start `nproc` workers, wait for all; kill everyone and fail as soon as one dies or the deadline passes."
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra or {})
    port = str(free_port())
    logs = [open(f"{out}.{i}.log", "w+") for i in range(nproc)]   # files, not pipes: a full pipe would block a worker
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(nproc), port, str(out)], env=env,
                              stdout=logs[i], stderr=subprocess.STDOUT, text=True) for i in range(nproc)]
    start = time.monotonic()
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i, c = bad[0]
                logs[i].seek(0)
                raise RuntimeError(f"process {i} of {nproc} exited with {c}: {logs[i].read()[-2000:]}")
            if all(c == 0 for c in codes): return json.loads(Path(out).read_text())
            if time.monotonic() - start > deadline:
                raise TimeoutError(f"the {nproc}-process job did not finish within {deadline} s")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
        for p in procs: p.wait()
        for f in logs: f.close()


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    one = run_job(1, tmp_path / "one.json")
    two = run_job(2, tmp_path / "two.json")
    assert one["processes"] == 1 and two["processes"] == 2
    assert abs(two["loss"] - one["loss"]) <= 1e-5, (two, one)
    assert abs(two["checksum"] - one["checksum"]) <= 1e-3 * max(1.0, abs(one["checksum"])), (two, one)


@pytest.mark.slow
def test_a_dead_process_fails_the_job_fast(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="process 1 of 2 exited with 3"):
        run_job(2, tmp_path / "x.json", env_extra={"MESHTX_TEST_DIE": "1"})
    assert time.monotonic() - t0 < 60
