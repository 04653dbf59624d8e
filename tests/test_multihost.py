"""Two real processes x 4 CPU devices, joined through jax.distributed on 127.0.0.1, train like one process with 8."""
import json, os, socket, subprocess, sys, time
from pathlib import Path
import pytest

# processes that meet in collectives, on deadlines: not beside other tests. Those marked `compat` also run under
# jax==0.7.2 (joining, training like one process, failing fast); the others only under the newest JAX (CI's time)
pytestmark = pytest.mark.serial

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def run_job(nproc, out, deadline=60, env_extra=None, worker=WORKER, args=()):
    "Start `nproc` workers, wait for all; kill everyone and fail as soon as one dies or the deadline passes."
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra or {})
    port = str(free_port())
    logs = [open(f"{out}.{i}.log", "w+") for i in range(nproc)]   # files, not pipes: a full pipe would block a worker
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(nproc), port, str(out), *map(str, args)], env=env,
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
@pytest.mark.compat
def test_two_processes_train_like_one(tmp_path):
    one = run_job(1, tmp_path / "one.json")
    two = run_job(2, tmp_path / "two.json")
    assert one["processes"] == 1 and two["processes"] == 2
    assert abs(two["loss"] - one["loss"]) <= 1e-5, (two, one)
    assert abs(two["checksum"] - one["checksum"]) <= 1e-3 * max(1.0, abs(one["checksum"])), (two, one)


@pytest.mark.slow
@pytest.mark.compat
def test_a_dead_process_fails_the_job_fast(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="process 1 of 2 exited with 3"):
        run_job(2, tmp_path / "x.json", env_extra={"MESHTX_TEST_DIE": "1"})
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_two_processes_fine_tune_like_one(tmp_path):
    "Trainer + Loader + Checkpointer across two processes: same losses, and checkpoints with the same contents."
    import numpy as np
    import pydoc_data.topics as topics
    from meshtx.data import prepare_data
    from meshtx.tokenizer import ByteTokenizer
    from meshtx.checkpoint import Checkpointer
    (tmp_path / "docs.txt").write_text("\n".join(topics.topics[k] for k in sorted(topics.topics)[:10]))
    prepare_data(tmp_path / "docs.txt", tmp_path / "data", ByteTokenizer(), seq=32, val_fraction=0.1, progress=False)
    worker = Path(__file__).with_name("multihost_train_worker.py")
    one = run_job(1, tmp_path / "one.json", deadline=120, worker=worker, args=[tmp_path])
    two = run_job(2, tmp_path / "two.json", deadline=120, worker=worker, args=[tmp_path])
    assert two["processes"] == 2
    np.testing.assert_allclose(two["losses"], one["losses"], atol=1e-5)
    assert abs(two["val"] - one["val"]) <= 1e-5
    assert two["generated"] == one["generated"] == two["streamed"] and len(two["generated"][1]) == 5   # rows gathered
    a, _ = Checkpointer(tmp_path / "ckpt-1").restore()
    b, meta = Checkpointer(tmp_path / "ckpt-2").restore()
    assert meta["data"]["position"] == 3
    import jax
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), a["params"], b["params"])


@pytest.mark.slow
def test_a_batch_that_does_not_split_trains_like_one_process(tmp_path):
    "6 rows over fsdp=4 are replicated: each process's rows are gathered first, not taken for the whole batch."
    import numpy as np
    worker = Path(__file__).with_name("multihost_odd_batch_worker.py")
    one = run_job(1, tmp_path / "one.json", deadline=120, worker=worker)
    two = run_job(2, tmp_path / "two.json", deadline=120, worker=worker)
    assert two["processes"] == 2
    np.testing.assert_allclose(two["losses"], one["losses"], atol=1e-5)
    assert abs(two["val"] - one["val"]) <= 1e-5, (two, one)


def run_cli(nproc, argv, cwd, deadline=300, env_extra=None):
    "Run `meshtx ARGV` as `nproc` processes of one job (the MESHTX_* variables, one CPU device each); their outputs."
    import shutil
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(MESHTX_CACHE_DIR="off", **(env_extra or {}))
    job = lambda i: {} if nproc == 1 else {"MESHTX_COORDINATOR": f"127.0.0.1:{port}", "MESHTX_NUM_PROCESSES": str(nproc),
                                           "MESHTX_PROCESS_ID": str(i)}
    logs = [open(Path(cwd) / f"cli.{i}.log", "w+") for i in range(nproc)]
    procs = [subprocess.Popen([exe, *argv], env={**env, **job(i)}, cwd=cwd, stdout=logs[i], stderr=subprocess.STDOUT, text=True)
             for i in range(nproc)]
    try:
        for i, p in enumerate(procs):
            p.wait(timeout=max(1, deadline))
            logs[i].seek(0)
            out = logs[i].read()
            assert p.returncode == 0, f"process {i} of {nproc} exited with {p.returncode}: {out[-3000:]}"
        outs = []
        for f in logs: f.seek(0); outs.append(f.read())
        return outs
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
        for p in procs: p.wait()
        for f in logs: f.close()


@pytest.mark.slow
@pytest.mark.compat
def test_the_cli_joins_a_job(tmp_path):
    "With MESHTX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID set, each `meshtx` process is one process of the job."
    outs = run_cli(2, ["info"], tmp_path, deadline=120)
    for i, out in enumerate(outs):
        lines = dict(l.split(None, 1) for l in out.splitlines() if l[:1].isalpha() and len(l.split(None, 1)) == 2)
        assert lines["process"] == f"{i} of 2", out
        assert lines["devices"].startswith("2 × ") and "(local 1)" in lines["devices"], out


@pytest.mark.slow
def test_two_cli_processes_train_one_model(tmp_path):
    "`meshtx train` started on two processes trains one model (the losses of one process with both devices), "
    "process 0 prints the log, and the model it leaves can be sampled."
    import pydoc_data.topics as topics
    (tmp_path / "docs.txt").write_text("\n\n".join(topics.topics[k] for k in sorted(topics.topics)[:20]))
    run = {"layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 257, "pe_rotary_dims": 8, "seq": 32, "tokenizer": "bytes",
           "per_replica_batch": 4, "total_steps": 3, "lr": 3e-3, "train_set": "docs.txt"}
    for name in ("one", "two"): (tmp_path / f"{name}.json").write_text(json.dumps({**run, "model_dir": name}))
    one = run_cli(1, ["train", "--config", "one.json", "-q"], tmp_path,
                  env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})[0]
    two = run_cli(2, ["train", "--config", "two.json", "-q"], tmp_path)
    steps = lambda out: [json.loads(l) for l in out.splitlines() if l.startswith('{"step"')]
    assert [r["step"] for r in steps(two[0])] == [1, 2, 3] and steps(two[1]) == [], two   # process 0 speaks
    for a, b in zip(steps(one), steps(two[0])): assert abs(a["loss"] - b["loss"]) <= 1e-5, (one, two[0])
    assert (tmp_path / "two" / "model" / "config.json").exists()
    out = run_cli(1, ["sample", "--model", "two/model", "--prompt", "def", "--max-new-tokens", "4", "--seed", "0", "-q"], tmp_path)[0]
    assert out.strip(), out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "A tiny model with a byte tokenizer, saved in both formats, and a few documents to fine-tune on."
    import pydoc_data.topics as topics
    from meshtx import LM, ModelConfig
    from meshtx.tokenizer import ByteTokenizer
    d = tmp_path_factory.mktemp("tiny")
    lm = LM.init(ModelConfig(n_layer=1, d_model=32, n_head=4, rotary_dim=8, n_vocab=257, n_ctx=64), seed=1,
                 tokenizer=ByteTokenizer(), dtype="float32")
    lm.save_hf(d / "hf"); lm.save(d / "mx")
    (d / "docs.txt").write_text("\n\n".join(topics.topics[k] for k in sorted(topics.topics)[:6]))
    return d


FIXES = Path(__file__).with_name("multihost_fixes_worker.py")

def fixes_job(work, mode, nproc=2, deadline=120):
    "Run `mode` of multihost_fixes_worker.py as `nproc` processes; what each process saw."
    run_job(nproc, work / f"{mode}.json", deadline=deadline, worker=FIXES, args=[work, mode])
    return [json.loads((work / f"{mode}.json.{i}").read_text()) for i in range(nproc)]


@pytest.mark.slow
def test_a_model_loaded_without_a_mesh_works_on_every_process(tiny):
    "Each process holds it on its own device (not process 0's), and can shard it onto the job's mesh."
    a, b = fixes_job(tiny, "load")
    assert a["processes"] == 2 and a == b
    assert a["hf"] == a["mx"] == a["hf_sharded"] == a["mx_sharded"]


@pytest.mark.slow
def test_share_takes_64_bit_integers_and_refuses_others_on_every_process(tiny):
    for r in fixes_job(tiny, "share"):
        assert (r["big"], r["negative"], r["after"]) == (2**31 + 7, -2**40, 3)
        assert "integer" in r["float"]


@pytest.mark.slow
def test_global_batch_gathers_rows_when_the_mesh_does_not_split_them_by_process(tiny):
    "mp=2 over two processes: the batch is replicated, so every process needs both processes' rows."
    whole = [list(range(3 * i, 3 * i + 3)) for i in range(8)]
    for r in fixes_job(tiny, "batch"):
        assert r["dp"] == r["mp"] == r["fsdp"] == whole, r


@pytest.mark.slow
def test_saves_across_processes_gather_and_process_0_writes(tiny):
    import numpy as np
    from meshtx import LM
    rs = fixes_job(tiny, "save")
    assert rs[0]["split"] and rs[0] == rs[1]
    import jax
    want = LM.load(tiny / "mx", dtype="float32", progress=False).params
    for name in ("hf", "mx", "merged"):
        got = LM.load(rs[0][name], dtype="float32", progress=False).params
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), got, want)   # (new adapters merge to 0)


@pytest.mark.slow
def test_finetune_across_processes_with_an_odd_number_of_held_out_windows(tiny):
    "3 held-out windows, 2 processes: a val batch of 2; process 0 alone logs and plots."
    from meshtx.data import TokenData
    a, b = fixes_job(tiny, "finetune", deadline=240)
    assert TokenData.open(tiny / "ft" / "data").n("val") % 2 == 1
    assert a["result"]["val_loss_before"] is not None and a["result"] == b["result"]
    assert any("held-out loss before" in l for l in a["logs"]) and b["logs"] == []
    assert (tiny / "ft" / "loss.png").exists() and (tiny / "ft" / "model" / "config.json").exists()


def meshtx_cli(argv, env_extra, **kw):
    "`meshtx ARGV` as a process of its own, with `env_extra` (and no job variables but those)."
    import shutil
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("MESHTX_")}
    return subprocess.Popen([exe, *argv], env={**env, "MESHTX_CACHE_DIR": "off", **env_extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("env, says", [
    ({"MESHTX_COORDINATOR": "localhost", "MESHTX_NUM_PROCESSES": "2", "MESHTX_PROCESS_ID": "0"}, "must be host:port"),
    ({"MESHTX_PROCESS_ID": "1"}, "MESHTX_PROCESS_ID"),
    ({"MESHTX_NUM_PROCESSES": "1", "MESHTX_PROCESS_ID": "1"}, "MESHTX_PROCESS_ID")])
def test_the_cli_refuses_a_job_it_cannot_join(env, says):
    out, _ = meshtx_cli(["info"], env).communicate(timeout=60)
    assert "meshtx: error: could not join the job" in out and says in out, out


def test_initialize_names_a_variable_that_is_not_a_number(monkeypatch):
    from meshtx.distributed import initialize
    monkeypatch.setenv("MESHTX_COORDINATOR", "127.0.0.1:1"); monkeypatch.setenv("MESHTX_NUM_PROCESSES", "abc")
    with pytest.raises(ValueError, match="MESHTX_NUM_PROCESSES='abc' must be a whole number"): initialize()


@pytest.mark.slow
def test_sigterm_ends_a_cli_process_waiting_to_join():
    "Process 1 of a job whose coordinator never comes: waiting inside JAX's connect, SIGTERM still ends it."
    import signal
    p = meshtx_cli(["info"], {"MESHTX_COORDINATOR": f"127.0.0.1:{free_port()}", "MESHTX_NUM_PROCESSES": "2",
                              "MESHTX_PROCESS_ID": "1"})
    try:
        time.sleep(8)   # JAX imported, and waiting for the coordinator
        assert p.poll() is None, p.communicate()[0]
        p.send_signal(signal.SIGTERM); t0 = time.monotonic()
        p.wait(timeout=10)
        assert time.monotonic() - t0 < 5 and p.returncode != 0
    finally:
        if p.poll() is None: p.kill(); p.wait()
