"""Shared helpers for the system tests: tiny random Hugging Face GPT-J checkpoints made on the spot."""
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import tempfile
from pathlib import Path
# 8 simulated CPU devices (before JAX starts), so the sharding tests can build every mesh
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# the CLI enables JAX's persistent compilation cache; keep the tests' cache out of the user's home. The test processes
# use it too (tools/test.sh points the notebooks' at the same directory): many tests compile the same programs.
os.environ.setdefault("MESHTX_CACHE_DIR", tempfile.mkdtemp(prefix="meshtx-test-cache-"))
if os.environ["MESHTX_CACHE_DIR"].lower() != "off":
    from meshtx.lm import enable_compilation_cache
    enable_compilation_cache(os.environ["MESHTX_CACHE_DIR"])
import numpy as np
import pytest


# The slowest files first (by their measured seconds on two cores), so that pytest-xdist's two workers, which take a file at a
# time (tools/test.sh: --dist loadfile --no-loadscope-reorder), finish together instead of one waiting on the other's
# last big file. Files not named run after these, in their usual order.
SLOWEST_FIRST = ("test_families_frontends", "test_bench", "test_cli", "test_train", "test_bench_scale", "test_compiled",
                 "test_slots", "test_serve", "test_sampling", "test_demo", "test_sharding", "test_evaluate", "test_families",
                 "test_packaging", "test_weights")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: a file's tests keep their order


def make_hf_model(config, seed=0, scale=True):
    """A random `GPTJForCausalLM` for a meshtx `ModelConfig`.

    HF initialises weights with std 0.02, which makes every logit nearly 0 and a parity test nearly
    vacuous; with `scale`, weights get std 0.2 and LayerNorms/biases std 0.5, so logits are O(1-10)
    and their argmax is meaningful."""
    import torch, transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.GPTJForCausalLM(config.to_hf()).eval()
    if scale:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1: p.normal_(1.0 if name.endswith("ln_1.weight") or name.endswith("ln_f.weight") else 0.0, 0.5)
                else: p.normal_(0.0, 0.2)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    "Factory: save a random HF GPT-J for `config` into a new directory; returns (dir, torch model)."
    def make(config, seed=0, name="ckpt", **save_kwargs):
        model = make_hf_model(config, seed)
        path = tmp_path / name
        model.save_pretrained(path, **save_kwargs)
        return path, model
    return make


def hf_logits(model, tokens, attention_mask=None):
    import torch
    with torch.no_grad():
        kw = {} if attention_mask is None else {"attention_mask": torch.tensor(np.asarray(attention_mask))}
        return model(torch.tensor(np.asarray(tokens)), **kw).logits.float().numpy()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_bucket():
    """A real GCS emulator (gcp-storage-emulator, with the move API it lacks: tests/gcs_emulator.py) on 127.0.0.1 for
    the session; yields a `gs://` bucket URL.

    The environment variables are set before gcsfs is first used, and are inherited by subprocesses."""
    import subprocess, sys, time, urllib.request
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "gcs_emulator.py"), "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory", "--default-bucket", "meshtx-test"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/storage/v1/b", timeout=1); break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill(); raise RuntimeError("the GCS emulator did not start")
            time.sleep(0.2)
    old = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = url
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"   # else gcsfs stalls 60 s per bucket
    try:
        yield "gs://meshtx-test"
    finally:
        proc.terminate()
        try: proc.wait(10)
        except subprocess.TimeoutExpired: proc.kill()
        for k, v in old.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v


def write_task(root, name, rows, **config):
    "A local lm-eval task `name` in directory `root`: its `rows` as a jsonl file, and its yaml (`config` on top)."
    import json, yaml
    (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"task": name, "dataset_path": "json", "test_split": "test",
              "dataset_kwargs": {"data_files": {"test": str(root / f"{name}.jsonl")}}, **config}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))


def assert_same(a, b, tol=1e-4):
    "Equal strings and bools, and numbers within `tol` (relative for large ones), nested in lists and tuples."
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b): assert_same(x, y, tol)
    elif isinstance(a, (bool, np.bool_, str)) or a is None: assert a == b, (a, b)
    else: assert abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b))), (a, b)
