"""Saved models on gs:// (a real GCS emulator on 127.0.0.1): save, load, adapters, fine-tune output, configs.

Every path that takes a model directory takes a gs:// URL too, goes to the bucket (not to a local folder called
"gs:"), refuses to overwrite a save file by file, and names a missing bucket before doing any work."""
import json, os, shutil, subprocess, sys, uuid
from pathlib import Path
import numpy as np
import numpy.testing as npt
import pytest
from meshtx import LM, ModelConfig
from meshtx.storage import filesystem
from meshtx.tokenizer import ByteTokenizer

TINY = dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=257, n_ctx=64)


@pytest.fixture
def where(gcs_bucket, tmp_path, monkeypatch):
    "A fresh folder in the bucket; the working directory and the download cache are in tmp_path."
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHTX_REMOTE_CACHE", str(tmp_path / "cache"))
    return f"{gcs_bucket}/t-{uuid.uuid4().hex[:8]}"


def listing(url):
    fs, root = filesystem(url)
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) if fs.exists(root) else []


def test_save_and_load_both_formats(where, tmp_path):
    lm = LM.init(ModelConfig(**TINY), seed=3, tokenizer=ByteTokenizer())
    want = np.asarray(lm.logits("hello"))
    lm.save(f"{where}/mx")
    lm.save_hf(f"{where}/hf", progress=False)
    assert not Path("gs:").exists()                                  # nothing went to a local folder named "gs:"
    assert "meshtx_config.json" in listing(f"{where}/mx") and "config.json" in listing(f"{where}/hf")
    for url in (f"{where}/mx", f"{where}/hf", f"{where}/hf/"):
        back = LM.load(url, dtype="float32", progress=False)
        assert isinstance(back.tokenizer, ByteTokenizer)                # the tokenizer travelled with the weights
        npt.assert_allclose(np.asarray(back.logits("hello")), want, atol=1e-6)
    npt.assert_allclose(np.asarray(LM.from_hf(f"{where}/hf", dtype="float32", progress=False).logits("hello")), want, atol=1e-6)
    # a second save to the same URL is refused, and the first one still loads
    with pytest.raises(FileExistsError, match="is not empty"):
        LM.init(ModelConfig(**TINY), seed=4, tokenizer=ByteTokenizer()).save_hf(f"{where}/hf", progress=False)
    npt.assert_allclose(np.asarray(LM.load(f"{where}/hf", dtype="float32", progress=False).logits("hello")), want, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LM.load(f"{where}/nothing-here", progress=False)
    from meshtx.data import resolve_tokenizer
    assert isinstance(resolve_tokenizer(f"{where}/hf"), ByteTokenizer)   # a run config's "tokenizer": "gs://..."


def test_adapters(where):
    lm = LM.init(ModelConfig(**TINY), seed=3, tokenizer=ByteTokenizer())
    lm.add_lora(4)
    import jax
    lm.params = jax.tree.map(lambda x: x + 0.01, lm.params)          # adapters that change the output
    want = np.asarray(lm.logits("hello"))
    lm.save_adapters(f"{where}/ad")
    assert listing(f"{where}/ad") == ["lora.json", "lora.safetensors"]
    base = LM.init(ModelConfig(**TINY), seed=3, tokenizer=ByteTokenizer())
    base.params = jax.tree.map(lambda x: x + 0.01, base.params)
    npt.assert_allclose(np.asarray(base.load_adapters(f"{where}/ad").logits("hello")), want, atol=1e-5)
    with pytest.raises(FileExistsError): lm.save_adapters(f"{where}/ad")


def test_missing_bucket_is_named_before_work(gcs_bucket, tmp_path):
    from meshtx.checkpoint import Checkpointer
    from meshtx.data import prepare_data
    lm = LM.init(ModelConfig(**TINY), tokenizer=ByteTokenizer())
    for save in (lambda u: lm.save(u), lambda u: lm.save_hf(u, progress=False),
                 lambda u: Checkpointer(u).save(1, {"x": np.ones(3)})):
        with pytest.raises(FileNotFoundError, match="bucket gs://no-such-bucket-x does not exist"):
            save("gs://no-such-bucket-x/m")
    (tmp_path / "a.txt").write_text("some text " * 50)
    with pytest.raises(FileNotFoundError, match="bucket gs://no-such-bucket-x does not exist"):
        prepare_data(tmp_path / "a.txt", "gs://no-such-bucket-x/ds", ByteTokenizer(), seq=8, progress=False)


def test_finetune_into_the_bucket(where, tmp_path):
    "`meshtx finetune --model gs://... --out gs://...`: every output lands in the bucket."
    lm = LM.init(ModelConfig(**TINY), tokenizer=ByteTokenizer())
    lm.save(f"{where}/base")
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 100)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    r = subprocess.run([exe, "finetune", "--model", f"{where}/base", "--data", str(tmp_path / "a.txt"),
                        "--out", f"{where}/ft", "--lora", "4", "--steps", "2", "--batch", "4", "--seq", "32", "-q"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{where}/ft/model" in r.stdout and not (tmp_path / "gs:").exists()
    assert {"adapters", "checkpoints", "data", "loss.png", "model"} <= set(listing(f"{where}/ft"))
    assert LM.load(f"{where}/ft/model", progress=False).config.n_layer == 2
    fs, root = filesystem(f"{where}/ft/model")
    fs.invalidate_cache()
    for p in sorted(fs.ls(root), key=lambda p: p.endswith("config.json"))[1:]: fs.rm(p)   # the model's upload cut short:
    assert "config.json" not in listing(f"{where}/ft/model")                                  # one file of it there
    again = subprocess.run(r.args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]   # the same command again writes it whole (it was "not empty")
    assert LM.load(f"{where}/ft/model", progress=False).config.n_layer == 2


def test_a_folder_made_in_the_cloud_console_takes_a_save(where):
    "The console's 'Create folder' writes a placeholder object `NAME/`: the folder is empty, and a save goes in."
    fs, root = filesystem(f"{where}/m")
    fs.pipe(root + "/", b"")
    lm = LM.init(ModelConfig(**TINY), tokenizer=ByteTokenizer())
    lm.save_hf(f"{where}/m", progress=False)
    assert LM.load(f"{where}/m", progress=False).config.d_model == 64


def test_a_tokenizer_upload_cut_short_is_not_loaded_and_is_written_again(where):
    "A Trainer keeps the tokenizer beside gs:// checkpoints; a folder without its marker is an upload cut short."
    import itertools
    from meshtx.train import Trainer
    from meshtx.tokenizer import gpt2_tokenizer
    lm = LM.init(ModelConfig(**{**TINY, "n_vocab": 50400}), tokenizer=gpt2_tokenizer())
    batch = np.random.RandomState(0).randint(0, 100, (2, 17))
    t = Trainer(lm, itertools.repeat(batch), lr=1e-3, checkpoint_dir=f"{where}/ck", progress=False)
    t.step(); t.save()
    fs, root = filesystem(f"{where}/ck/tokenizer")
    fs.invalidate_cache()
    assert "complete.json" in listing(f"{where}/ck/tokenizer")
    for p in fs.ls(root):
        if not p.endswith("tokenizer_config.json"): fs.rm(p)   # cut short: one file arrived
    fs.invalidate_cache()
    assert LM.load(f"{where}/ck", progress=False).tokenizer.encode("Hello world") == [15496, 995]   # not the partial one
    t.step(); t.save()   # the next save writes it whole
    assert "complete.json" in listing(f"{where}/ck/tokenizer") and "tokenizer.json" in listing(f"{where}/ck/tokenizer")


def test_configs_from_the_bucket(where):
    from meshtx.runs import load_run_config
    fs, root = filesystem(where)
    fs.pipe_file(f"{root}/run.json", json.dumps({"model_dir": f"{where}/run", "train_set": "x", "total_steps": 3,
                                                 "layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 257}).encode())
    assert load_run_config(f"{where}/run.json")["total_steps"] == 3
    fs.pipe_file(f"{root}/mtj.json", json.dumps({"layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 257, "seq": 64,
                                                 "pe_rotary_dims": 8}).encode())
    assert ModelConfig.from_mtj(f"{where}/mtj.json").n_layer == 2


def test_cli_convert_between_buckets(where):
    from meshtx.cli import main
    lm = LM.init(ModelConfig(**TINY), seed=5, tokenizer=ByteTokenizer())
    lm.save(f"{where}/mx")
    assert main(["convert", f"{where}/mx", f"{where}/hf", "-q"]) == 0          # meshtx -> Hugging Face, bucket to bucket
    assert main(["convert", f"{where}/hf", f"{where}/mx2", "-q"]) == 0         # and back
    npt.assert_allclose(np.asarray(LM.load(f"{where}/mx2", progress=False).logits("hi")), np.asarray(lm.logits("hi")), atol=1e-6)


def test_errors_about_a_bucket_checkpoint_name_the_bucket(where):
    "A loader reads a cached copy; what it finds wrong is named in the bucket, not in the cache."
    lm = LM.init(ModelConfig(**TINY), tokenizer=ByteTokenizer())
    lm.save_hf(f"{where}/m", progress=False)
    LM.load(f"{where}/m", progress=False)   # (cached now)
    fs, root = filesystem(f"{where}/m")
    fs.rm(f"{root}/model.safetensors")
    fs.invalidate_cache()
    with pytest.raises((FileNotFoundError, ValueError)) as e: LM.load(f"{where}/m", progress=False)
    assert f"{where}/m" in str(e.value) and "cache" not in str(e.value), str(e.value)


def test_a_bucket_dataset_prepared_again_under_an_open_reader_is_an_error(where, tmp_path):
    "Its header is the old one: rows of the new tokens under it would be wrong data, silently (a local one reads on)."
    from meshtx.data import TokenData, prepare_data
    (tmp_path / "a.txt").write_text("first corpus " * 200)
    prepare_data(tmp_path / "a.txt", f"{where}/ds", ByteTokenizer(), seq=15, progress=False)
    data = TokenData.open(f"{where}/ds")
    first = data.windows([0, 1])
    npt.assert_array_equal(data.windows([0, 1]), first)   # unchanged: read again, the same
    (tmp_path / "a.txt").write_text("a second, other corpus " * 300)
    prepare_data(tmp_path / "a.txt", f"{where}/ds", ByteTokenizer(), seq=15, progress=False)
    with pytest.raises(ValueError, match="was replaced while this dataset was open"): data.windows([0, 1])
    assert TokenData.open(f"{where}/ds").n_windows != data.n_windows


def test_a_publish_killed_in_the_bucket_leaves_no_object_behind(where, tmp_path, monkeypatch):
    "A killed publish's full-size temporary tokens object is deleted by a later prepare into the same place."
    import meshtx.data
    from meshtx.data import prepare_data
    fs, root = filesystem(f"{where}/ds")
    fs.pipe(f"{root}/.tokens.bin.0badc0de.tmp", b"\0" * 1000)   # as a kill during the upload leaves it
    (tmp_path / "a.txt").write_text("some corpus " * 100)
    prepare_data(tmp_path / "a.txt", f"{where}/ds", ByteTokenizer(), seq=15, progress=False)
    assert ".tokens.bin.0badc0de.tmp" in listing(f"{where}/ds")   # younger than an hour: maybe another run's
    monkeypatch.setattr(meshtx.data, "ABANDONED_AGE", 0)
    prepare_data(tmp_path / "a.txt", f"{where}/ds", ByteTokenizer(), seq=15, progress=False)
    assert listing(f"{where}/ds") == ["header.json", "tokens.bin"]


@pytest.fixture
def objects_only(gcs_bucket, monkeypatch):
    """A proxy in front of the emulator that answers 403 to reading a bucket's metadata, as GCS answers credentials
    that may read and write its objects only (roles/storage.objectAdmin); gcsfs goes through it from now on."""
    import http.client, re, threading
    from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
    up = os.environ["STORAGE_EMULATOR_HOST"].removeprefix("http://").split(":")
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def forward(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            if self.command == "GET" and re.fullmatch(r"/storage/v1/b/[^/?]+(\?.*)?", self.path):
                status, data, headers = 403, b'{"error": {"code": 403, "message": "no storage.buckets.get access"}}', []
            else:
                c = http.client.HTTPConnection(up[0], int(up[1]), timeout=60)
                c.request(self.command, self.path, body=body, headers={k: v for k, v in self.headers.items()
                                                                      if k.lower() not in ("host", "connection", "transfer-encoding")})
                r = c.getresponse(); status, data, headers = r.status, r.read(), r.getheaders()
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in ("content-length", "transfer-encoding", "connection"): self.send_header(k, v)
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = forward
    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fs, _ = filesystem(gcs_bucket)
    fs.mkdir(bucket := f"empty-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    yield f"gs://{bucket}"
    server.shutdown()


def test_credentials_for_objects_only_save_into_an_empty_bucket(objects_only, tmp_path, monkeypatch):
    "Without storage.buckets.get, an empty bucket looked missing: the save was refused as 'does not exist'."
    monkeypatch.setenv("MESHTX_REMOTE_CACHE", str(tmp_path / "cache"))
    lm = LM.init(ModelConfig(**TINY), tokenizer=ByteTokenizer())
    lm.save(f"{objects_only}/m")
    assert LM.load(f"{objects_only}/m", progress=False).config.d_model == 64
    with pytest.raises(FileNotFoundError, match="bucket gs://no-such-bucket-y does not exist"):
        lm.save("gs://no-such-bucket-y/m")
