"""Loading Hugging Face checkpoints in every form they come in, and refusing the ones that do not fit."""
import json, os, subprocess, sys, textwrap
from pathlib import Path
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from conftest import hf_logits
from meshtx import LM, ModelConfig

CFG = ModelConfig(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=512, n_ctx=64)
TOKENS = np.random.default_rng(0).integers(0, 512, (2, 11))


def assert_same_model(lm, model):
    np.testing.assert_allclose(np.asarray(lm.logits(TOKENS)), hf_logits(model, TOKENS), atol=1e-4, rtol=0)


@pytest.mark.parity
def test_sharded_safetensors(hf_checkpoint):
    path, model = hf_checkpoint(CFG, max_shard_size="50KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert_same_model(LM.from_hf(path, dtype="float32", progress=False), model)


def _bin_checkpoint(path, model, shards=1):
    import torch
    path.mkdir()
    model.config.save_pretrained(path)
    sd = model.state_dict()
    if shards == 1:
        torch.save(sd, path / "pytorch_model.bin"); return path
    names = list(sd); per = -(-len(names) // shards); weight_map = {}
    for i in range(shards):
        fn = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: sd[k] for k in names[i * per:(i + 1) * per]}, path / fn)
        weight_map.update({k: fn for k in names[i * per:(i + 1) * per]})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parity
@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_bin(shards, hf_checkpoint, tmp_path):
    _, model = hf_checkpoint(CFG)
    path = _bin_checkpoint(tmp_path / "bin", model, shards)
    assert_same_model(LM.from_hf(path, dtype="float32", progress=False), model)


def test_bf16_bin_and_safetensors(hf_checkpoint, tmp_path):
    "bf16 checkpoints (as published for many models) load in either format, exactly."
    import torch
    _, model = hf_checkpoint(CFG)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "st")
    _bin_checkpoint(tmp_path / "bin", model)
    a = LM.from_hf(tmp_path / "st", dtype="bfloat16", progress=False)
    b = LM.from_hf(tmp_path / "bin", dtype="bfloat16", progress=False)
    ref = model.state_dict()["transformer.h.1.mlp.fc_in.weight"].float().numpy()   # [out, in], as meshtx stores it
    for lm in (a, b):
        np.testing.assert_array_equal(np.asarray(lm.params["gptj/blocks/mlp/fc_in"]["w"][1], np.float32), ref)


def _cached_bytes(fn) -> int:
    "Bytes of file `fn` in the page cache (util-linux's fincore)."
    return int(subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(fn)],
                              capture_output=True, text=True, check=True).stdout.strip() or 0)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("tight", [True, False])
def test_checkpoint_pages_dropped_only_when_memory_is_tight(fmt, tight, hf_checkpoint, tmp_path, monkeypatch):
    """Where the weights and the checkpoint's page cache cannot both stay in memory, the loader drops each chunk's pages
    once read (the kernel would evict them anyway, slowly); elsewhere the cache stays for the next load. Same weights."""
    import meshtx.weights as W
    cfg = ModelConfig(n_layer=2, d_model=256, n_head=4, rotary_dim=8, n_vocab=4096, n_ctx=64)   # 14.7 MB: tensors
    path, model = hf_checkpoint(cfg)        # of whole pages (the kernel drops whole pages, whole large folios, only)
    if fmt == "bin": path = _bin_checkpoint(tmp_path / "bin", model)
    files = W.checkpoint_files(path)
    os.sync()   # dirty pages cannot be dropped
    for f in files: f.read_bytes()
    assert all(_cached_bytes(f) > 0 for f in files)
    monkeypatch.setattr(W, "_memory_tight", lambda host, fns: tight)
    lm = LM.from_hf(path, dtype="float32", progress=False)
    cached = sum(_cached_bytes(f) for f in files)
    size = sum(f.stat().st_size for f in files)
    if tight: assert cached < 0.25 * size, (cached, size)   # headers and the pages at tensors' edges stay
    else: assert cached >= size, (cached, size)
    ref = model.state_dict()["transformer.h.1.mlp.fc_in.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(lm.params["gptj/blocks/mlp/fc_in"]["w"][1]), ref)


def test_memory_tight_counts_weights_and_files(tmp_path):
    import meshtx.weights as W
    f = tmp_path / "f"; f.write_bytes(b"x" * 1000)
    assert not W._memory_tight(0, [f])
    assert W._memory_tight(1 << 60, [f])


def test_old_checkpoints_with_mask_buffers_load(hf_checkpoint):
    "The original GPT-J export carries attn.bias / attn.masked_bias buffers: they are not weights."
    path, model = hf_checkpoint(CFG)
    sd = load_file(path / "model.safetensors")
    sd["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), bool))
    sd["transformer.h.0.attn.masked_bias"] = np.array(-1e9, np.float32)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    assert_same_model(LM.from_hf(path, dtype="float32", progress=False), model)


def _edit(path, fn):
    sd = load_file(path / "model.safetensors"); fn(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_checkpoint):
    path, _ = hf_checkpoint(CFG)
    _edit(path, lambda sd: sd.pop("transformer.h.1.attn.q_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'transformer\.h\.1\.attn\.q_proj\.weight'"):
        LM.from_hf(path, progress=False)


def test_wrong_shape_names_tensor_and_both_shapes(hf_checkpoint):
    path, _ = hf_checkpoint(CFG)
    _edit(path, lambda sd: sd.__setitem__("transformer.h.0.mlp.fc_out.weight", np.zeros((64, 100), np.float32)))
    with pytest.raises(ValueError) as e:
        LM.from_hf(path, progress=False)
    assert "tensor 'transformer.h.0.mlp.fc_out.weight' has shape (64, 100) in model.safetensors, " \
           "but the config expects (64, 256)" in str(e.value)


@pytest.mark.parametrize("field,value,expect", [
    ("n_layer", 3, "missing tensor 'transformer.h.2.ln_1.weight'"),
    ("n_layer", 1, "unexpected tensor 'transformer.h.1.ln_1.weight' in model.safetensors"),
    ("n_embd", 128, "tensor 'transformer.wte.weight' has shape (512, 64) in model.safetensors, but the config expects (512, 128)"),
    ("vocab_size", 500, "tensor 'lm_head.bias' has shape (512,) in model.safetensors, but the config expects (500,)"),
])
def test_config_not_matching_tensors(field, value, expect, hf_checkpoint):
    path, _ = hf_checkpoint(CFG)
    cfg = json.loads((path / "config.json").read_text()); cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(ValueError) as e:
        LM.from_hf(path, progress=False)
    assert expect in str(e.value)
    assert (path / "model.safetensors").read_bytes() == before   # nothing touched


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LM.from_hf(tmp_path, progress=False)


def test_no_weights_in_dir(tmp_path):
    CFG.to_hf().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no model.safetensors, pytorch_model.bin or index json"):
        LM.from_hf(tmp_path, progress=False)


def test_tokenizer_from_checkpoint_and_default(tmp_path, hf_checkpoint):
    from meshtx import gpt2_tokenizer, EOT
    big = ModelConfig(n_layer=1, d_model=32, n_head=2, rotary_dim=8, n_vocab=50400, n_ctx=64)
    path, _ = hf_checkpoint(big)
    lm = LM.from_hf(path, progress=False)            # no tokenizer files: GPT-2's, as GPT-J uses
    assert lm.tokenizer("Hello world").input_ids == [15496, 995]
    gpt2_tokenizer().save_pretrained(path)
    lm = LM.from_hf(path, progress=False)            # tokenizer files: loaded through AutoTokenizer
    assert lm.tokenizer("Hello world").input_ids == [15496, 995] and lm.tokenizer.eos_token_id == EOT == 50256
    assert lm.logits("Hello world").shape == (1, 2, 50400)


def _fake_hub_cache(cache, repo_id, src):
    "Lay out `src` as huggingface_hub's cache would after downloading `repo_id`."
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir(): (snap / f.name).write_bytes(f.read_bytes())


def test_hub_id_through_huggingface_hub_cache(tmp_path, hf_checkpoint):
    "A hub id resolves through huggingface_hub (offline here: from its cache) to the same model."
    path, model = hf_checkpoint(CFG)
    _fake_hub_cache(tmp_path / "hub", "someone/tiny-gptj", path)
    code = textwrap.dedent("""
        import numpy as np, sys
        from meshtx import LM
        lm = LM.from_hf("someone/tiny-gptj", dtype="float32", progress=False)
        np.save(sys.argv[1], np.asarray(lm.logits(np.load(sys.argv[2]))))
        try: LM.from_hf("someone/not-cached", progress=False)
        except ValueError as e: print("ERR", e)
    """)
    np.save(tmp_path / "tokens.npy", TOKENS)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out.npy"), str(tmp_path / "tokens.npy")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), hf_logits(model, TOKENS), atol=1e-4, rtol=0)
    assert "ERR 'someone/not-cached' is not a local directory, and fetching it from the Hugging Face hub failed" in r.stdout


# A save killed at any point (SIGKILL, from an audit hook right before a chosen filesystem step) leaves the earlier
# save or the new one, whole with its tokenizer; never a mix, never nothing. The next save cleans up after it.
KILLED_SAVE = textwrap.dedent("""
    import os, sys, signal
    from meshtx import LM, ModelConfig
    from meshtx.tokenizer import ByteTokenizer
    method, path, event, where, nth = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    lm = LM.init(ModelConfig(**eval(sys.argv[6])), seed=1, tokenizer=ByteTokenizer())
    seen = []
    def hook(ev, args):
        if ev == event and where in " ".join(map(str, args[:2])):
            seen.append(ev)
            if len(seen) == nth: os.kill(os.getpid(), signal.SIGKILL)
    sys.addaudithook(hook)
    lm.save_hf(path, max_shard_size="100KB", progress=False) if method == "save_hf" else lm.save(path)
""")
BYTES = dict(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=257, n_ctx=64)


@pytest.mark.slow
@pytest.mark.parametrize("method,event,where,nth,expect", [
    ("save_hf", "open", "/.m.new-", 1, "v1"),         # while the new save is being written (its config.json)
    ("save_hf", "os.rename", ".m.old-", 1, "v1"),     # before the earlier save is moved aside
    ("save_hf", "os.rename", "/.m.new-", 1, "v1"),    # between the two renames: `m` missing, the earlier one aside
    ("save_hf", "os.rename", ".m.del-", 1, "v2"),     # the new one in, the earlier one not yet deleted
    ("save_hf", "os.remove", "model-0000", 2, "v2"),  # the earlier one half deleted (rmtree removes names in a dir fd)
    ("save", "open", "meshtx_tokenizer.json", 1, "v1"),   # while the tokenizer is written
    ("save", "os.rename", "/.m.new-", 1, "v1"),
])
def test_killed_save_leaves_a_whole_save(method, event, where, nth, expect, tmp_path):
    from meshtx.tokenizer import ByteTokenizer
    import warnings
    v1, v2 = (LM.init(ModelConfig(**BYTES), seed=s, tokenizer=ByteTokenizer()) for s in (0, 1))
    path = tmp_path / "m"
    save = (lambda lm: lm.save_hf(path, max_shard_size="300KB", progress=False)) if method == "save_hf" else (lambda lm: lm.save(path))
    save(v1)                                              # the earlier save (save_hf: other shards than the new one's)
    r = subprocess.run([sys.executable, "-c", KILLED_SAVE, method, str(path), event, where, str(nth), repr(BYTES)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr                   # killed where asked
    with warnings.catch_warnings(record=True):            # (a warning says when an earlier save is put back)
        back = LM.load(path, dtype="float32", progress=False)
    want = {"v1": v1, "v2": v2}[expect]                   # every tensor of one save: never a mix
    for mod, p in (("gptj/wte", "embedding"), ("gptj/blocks/mlp/fc_out", "w"), ("gptj/lm_head", "b")):
        np.testing.assert_array_equal(back.params[mod][p], want.params[mod][p])
    assert isinstance(back.tokenizer, ByteTokenizer)
    save(v2)                                              # the next save works, and removes what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    np.testing.assert_array_equal(LM.load(path, dtype="float32", progress=False).params["gptj/wte"]["embedding"],
                                  v2.params["gptj/wte"]["embedding"])


@pytest.mark.parametrize("what", ["shard", "tokenizer"])
def test_save_into_a_full_disk_keeps_the_earlier_save(what, tmp_path, monkeypatch):
    """The disk fills up at the second shard (safetensors says so in its own words) or in the tokenizer (tokenizers,
    in a bare Exception): an OSError names the file, the earlier save stays whole, nothing is left beside it."""
    import errno, meshtx.weights as W
    from meshtx.tokenizer import ByteTokenizer
    LM.init(ModelConfig(**BYTES), tokenizer=ByteTokenizer()).save_hf(tmp_path / "m", max_shard_size="100KB", progress=False)
    before = {f.name: f.read_bytes() for f in (tmp_path / "m").iterdir()}
    def full(*a, **k): raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    calls = []
    def second_shard_fails(*a, **k):
        calls.append(1)
        return full() if len(calls) == 2 else save_file(*a, **k)
    if what == "shard": monkeypatch.setattr(W, "save_file", second_shard_fails)
    else: monkeypatch.setattr(ByteTokenizer, "save_pretrained", full)
    with pytest.raises(OSError) as e:
        LM.init(ModelConfig(**BYTES), seed=1, tokenizer=ByteTokenizer()).save_hf(tmp_path / "m", max_shard_size="100KB", progress=False)
    named = Path(e.value.filename)
    assert e.value.errno == errno.ENOSPC and named.parent == tmp_path / "m"
    assert named.name.startswith("model-00002-of-") if what == "shard" else named.name == "tokenizer.json"
    assert {f.name: f.read_bytes() for f in (tmp_path / "m").iterdir()} == before   # nothing replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]                      # nothing left beside it


def test_saved_files_follow_the_umask(tmp_path):
    "safetensors writes -rw-------; meshtx's saves give every file the mode `open` would (umask 022: -rw-r--r--)."
    import stat
    lm = LM.init(CFG, tokenizer=None)
    old = os.umask(0o022)
    try:
        lm.save(tmp_path / "mt"); lm.save_hf(tmp_path / "hf")
        os.umask(0o027); lm.save(tmp_path / "mt27")
    finally: os.umask(old)
    for d, want in (("mt", 0o644), ("hf", 0o644), ("mt27", 0o640)):
        files = [p for p in (tmp_path / d).iterdir() if p.is_file()]
        assert any(p.suffix == ".safetensors" for p in files)
        assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(want) for p in files}


def _set_config(path, **changes):
    d = json.loads((path / "config.json").read_text()); d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("field,value,message", [
    ("n_layer", 10**9, "n_layer=1000000000 is larger than meshtx's limit of 1,024"),
    ("n_layer", 10**6, "n_layer=1000000 is larger than meshtx's limit of 1,024"),
    ("vocab_size", 10**12, "n_vocab=1000000000000 is larger than meshtx's limit of 2,147,483,647"),
    ("n_positions", 10**9, "n_ctx=1000000000 is larger than meshtx's limit of 16,777,216"),
    ("eos_token_id", 10**12, "eos_token_id=1000000000000 is not a token id"),
])
def test_absurd_config_values_are_named_before_anything_is_allocated(field, value, message, hf_checkpoint):
    path, _ = hf_checkpoint(CFG)
    _set_config(path, **{field: value})
    with pytest.raises(ValueError) as e: LM.from_hf(path, progress=False)
    assert message in str(e.value) and len(str(e.value)) < 300


def test_a_thousand_missing_layers_is_a_short_message(hf_checkpoint):
    path, _ = hf_checkpoint(CFG)
    _set_config(path, n_layer=1000)
    with pytest.raises(ValueError) as e: LM.from_hf(path, progress=False)
    assert "missing tensor 'transformer.h.2." in str(e.value) and "... and 9960 more" in str(e.value)
    assert len(str(e.value)) < 3000


@pytest.mark.parametrize("text,message", [("[1, 2]", "holds a JSON list, not an object"), ('"gptj"', "holds a JSON str"),
                                          ("[" * 10**6, "is not valid JSON"), ('{"n_layer": 2, "n_embd"', "is not valid JSON")])
def test_config_json_that_is_not_an_object_is_named(text, message, hf_checkpoint):
    path, _ = hf_checkpoint(CFG)
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError) as e: LM.from_hf(path, progress=False)
    assert message in str(e.value) and "config.json" in str(e.value) and len(str(e.value)) < 500


def test_parameters_larger_than_memory_are_refused_before_allocating():
    import jax, jax.numpy as jnp
    import meshtx.weights as W
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {"m": {"w": jax.ShapeDtypeStruct((10**7, 10**6), jnp.bfloat16)}}   # 20 TB
    with pytest.raises(ValueError, match=r"the parameters need 20,000\.0 GB of host memory, which has"):
        W.assemble(shapes, {"m": {"w": one}}, [], progress=False)


def test_a_huge_damaged_safetensors_header_is_not_echoed(tmp_path):
    "A 5 MB header that is not valid: refused, naming the file, in a message of a few hundred characters."
    (tmp_path / "config.json").write_text(CFG.to_hf().to_json_string())
    bad = b'{"a": "' + b"x" * (5 << 20) + b'"'
    (tmp_path / "model.safetensors").write_bytes(len(bad).to_bytes(8, "little") + bad)
    with pytest.raises(ValueError) as e: LM.from_hf(tmp_path, progress=False)
    assert "model.safetensors" in str(e.value) and len(str(e.value)) < 1000


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_truncated_tokenizer_file_is_named(name, tmp_path, hf_checkpoint):
    from meshtx.tokenizer import load_tokenizer, gpt2_tokenizer
    path, _ = hf_checkpoint(CFG)
    gpt2_tokenizer().save_pretrained(path)
    text = (path / name).read_text()
    (path / name).write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"{name} is not valid JSON .*is the file complete"):
        load_tokenizer(path)


def test_save_hf_progress_bar_ends_at_the_total(tmp_path, capsys):
    lm = LM.init(CFG, tokenizer=None)
    lm.save_hf(tmp_path / "hf", max_shard_size="100KB")
    err = capsys.readouterr().err
    n = len(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"])
    assert f"{n}/{n}" in err and "100%" in err


def test_no_pytorch_notice_without_torch():
    "Without torch (Colab's TPU image), transformers' 'PyTorch was not found' notice is not printed (Voila: a red box)."
    code = ("import sys; sys.modules['torch'] = None\n"
            "from meshtx import LM\n"
            "lm = LM.init('demo'); print(lm.tokenizer('hi').input_ids, lm.config.to_hf().n_embd)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "PyTorch was not found" not in r.stderr and "[5303]" in r.stdout
    import transformers   # the setting was for that import only
    assert os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS") is None


def test_device_pieces_are_written_one_chunk_at_a_time(hf_checkpoint, monkeypatch):
    "On an accelerator each write replaces a donated buffer: chunks of one piece, read by several threads, go in in turn."
    import jax.numpy as jnp
    import meshtx.weights as W
    path, _ = hf_checkpoint(CFG)
    want = W.load_hf_params(path, CFG, progress=False)
    init = W._Piece.__init__
    def on_device(self, device, bounds, dtype):   # the accelerator path (`_put`), on this CPU
        init(self, device, bounds, dtype)
        self.host, self.buf = False, jnp.zeros(self.buf.shape, dtype)
    monkeypatch.setattr(W._Piece, "__init__", on_device)
    monkeypatch.setattr(W, "_threads", lambda: 4)
    got = W.load_hf_params(path, CFG, progress=False, chunk_bytes=1000)   # a few rows per chunk: many per piece
    for mod, ps in want.items():
        for p, x in ps.items(): np.testing.assert_array_equal(np.asarray(got[mod][p]), np.asarray(x), err_msg=f"{mod}/{p}")


def test_a_stale_copy_of_a_tensor_in_another_shard_is_not_read(hf_checkpoint):
    "The index says which shard holds each tensor: a zeroed copy left in another is not the model's (it was read if last)."
    path, model = hf_checkpoint(CFG, max_shard_size="50KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "transformer.wte.weight"
    for other in sorted(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])[-2:]:
        stale = load_file(path / other)
        stale[name] = np.zeros_like(load_file(path / index["weight_map"][name])[name])
        save_file(stale, path / other, metadata={"format": "pt"})
    assert_same_model(LM.from_hf(path, dtype="float32", progress=False), model)
    del index["weight_map"][name]   # and with no index naming it: which copy is the model's cannot be told
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor '{name}' is in both .* and the index names neither"):
        LM.from_hf(path, dtype="float32", progress=False)


def test_convert_keeps_the_weights_dtype_beside_another_safetensors_file(hf_checkpoint):
    "An adapter's bf16 safetensors beside float32 weights: the weights' dtype is theirs (it was the first file's by name)."
    import ml_dtypes
    from meshtx.cli import _stored_dtype
    path, _ = hf_checkpoint(CFG)
    save_file({"a": np.zeros((2, 2), ml_dtypes.bfloat16)}, path / "adapter_model.safetensors")
    assert _stored_dtype(path) == "float32"
