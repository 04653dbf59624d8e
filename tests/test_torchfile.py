"""meshtx.torchfile: PyTorch checkpoints (torch's zip format) read without torch, checked against torch's own values.

Files are written by torch itself where torch is installed; malicious and damaged files are built by hand."""
import collections, hashlib, json, os, pickle, subprocess, sys, warnings, zipfile
from pathlib import Path
import ml_dtypes
import numpy as np
import pytest

import meshtx.torchfile as torchfile
from meshtx.torchfile import TorchFile

MODULE_FILE = Path(torchfile.__file__)


def _np(t):
    "torch's values of tensor `t` as numpy (bfloat16 as ml_dtypes.bfloat16), contiguous."
    import torch
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype.itemsize <= 2 and t.dtype.is_floating_point and name != "float16":   # bfloat16, float8: numpy has none
        return t.view(torch.int16 if t.dtype.itemsize == 2 else torch.uint8).numpy().view(getattr(ml_dtypes, name))
    return t.numpy()


def _check_all(fn, sd):
    "Every tensor of `sd` (what was saved into `fn`) reads back exactly, whole and in row ranges."
    tf = TorchFile(fn)
    assert list(tf.keys()) == list(sd)
    for k, v in sd.items():
        want = _np(v)
        assert tf.shapes[k] == tuple(v.shape), k
        assert tf.dtypes[k] == want.dtype, k
        got = tf.read(k)
        assert got.flags.c_contiguous and got.flags.owndata and got.flags.writeable, k
        np.testing.assert_array_equal(got, want)
        if v.ndim:
            n = v.shape[0]
            for rows in (slice(0, 1), slice(1, 3), slice(n - 1, None), slice(0, n, 2), slice(3, 1), slice(None)):
                np.testing.assert_array_equal(tf.read(k, rows), want[rows], err_msg=f"{k} {rows}")
    return tf


def _zip(fn, members: dict, prefix="archive"):
    "A zip like torch's (members uncompressed, under one folder), built by hand."
    with zipfile.ZipFile(fn, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items(): z.writestr(f"{prefix}/{name}", data)
    return fn


def _members(fn) -> tuple[str, dict]:
    "The folder and `{name: bytes}` of a torch zip."
    with zipfile.ZipFile(fn) as z:
        prefix = z.namelist()[0].split("/")[0]
        return prefix, {n[len(prefix) + 1:]: z.read(n) for n in z.namelist()}


class Call:
    "Pickles as the call `f(*args)`: lets a test write any pickle, as an attacker can."
    def __init__(self, f, *args): self.f, self.args = f, args
    def __reduce__(self): return (self.f, self.args)


class CallThenBuild(Call):
    "Pickles as `f(*args)` followed by pickle's BUILD with `state` (which sets attributes of the result)."
    def __init__(self, f, args, state): self.f, self.args, self.state = f, args, state
    def __reduce__(self): return (self.f, self.args, self.state)


class Persistent:
    "Pickles as a persistent id (`BINPERSID`), as torch writes storages."
    def __init__(self, pid): self.pid = pid


class Global:
    "Pickles as the global `module.name` (GLOBAL opcode), whether or not it can be imported here (torch need not be)."
    def __init__(self, module, name): self.module, self.name = module, name
    def __call__(self, *args): raise TypeError("only for pickling")   # pickle wants a callable


def _pickle(obj) -> bytes:
    "`obj` pickled as torch pickles (protocol 2), with `Global`s, `Persistent` ids and `Call`s as written."
    class P(pickle._Pickler):   # the pure-Python pickler, whose `save` can be extended
        def persistent_id(self, o): return o.pid if isinstance(o, Persistent) else None
        def save(self, o, save_persistent_id=True):
            if isinstance(o, Global): return self.write(f"c{o.module}\n{o.name}\n".encode())
            return super().save(o, save_persistent_id)
    import io
    f = io.BytesIO(); P(f, protocol=2).dump(obj); return f.getvalue()


REBUILD_V2 = Global("torch._utils", "_rebuild_tensor_v2")
FLOAT = Global("torch", "FloatStorage")
HOOKS = Call(Global("collections", "OrderedDict"))


# ---- what torch writes --------------------------------------------------------------------------------------

def test_dtypes(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    sd = {"f32": torch.randn(7, 5), "f16": torch.randn(6, 3).half(), "bf16": torch.randn(5, 4).bfloat16(),
          "i64": torch.randint(-2**62, 2**62, (4, 2)), "f64": torch.randn(3, 2).double(),
          "i32": torch.randint(-9, 9, (5,), dtype=torch.int32), "i8": torch.randint(-9, 9, (4,), dtype=torch.int8),
          "u8": torch.randint(0, 255, (4,), dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
          "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16), "c64": torch.randn(3, dtype=torch.complex64),
          "f8": torch.randn(4).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 3), "long_1d": torch.arange(10)}
    torch.save(sd, tmp_path / "d.bin")
    tf = _check_all(tmp_path / "d.bin", sd)
    assert tf.dtypes["bf16"] == np.dtype(ml_dtypes.bfloat16)
    assert tf.dtypes["f8"] == np.dtype(ml_dtypes.float8_e4m3fn)


def test_views_shared_storage_scalars(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    base = torch.arange(40.0)
    m = torch.randn(6, 4)
    sd = {"t": m.t(),                                 # transposed view: strides (1, 4)
          "a": base[3:15].view(3, 4), "b": base[10:],  # two views of one storage, at offsets 3 and 10
          "w": m, "w_tied": m,                        # the same tensor twice (tied weights)
          "cols": m[:, 1:3],                           # a non-contiguous slice with an offset
          "step": base[::3],                           # stride 3
          "expanded": torch.randn(3).expand(5, 3),     # stride 0
          "scalar": torch.tensor(2.5), "scalar_i": torch.tensor(7),   # 0-d
          "neg": torch._neg_view(torch.randn(2, 3)), "conj": torch.randn(3, dtype=torch.complex64).conj(),
          "param": torch.nn.Parameter(torch.randn(2, 2))}
    torch.save(sd, tmp_path / "v.bin")
    tf = _check_all(tmp_path / "v.bin", sd)
    assert tf._t["a"].storage.key == tf._t["b"].storage.key and tf._t["b"].offset == 10
    assert tf._t["t"].stride == (1, 4)
    assert tf.shapes["scalar"] == () and tf.read("scalar").shape == ()
    with pytest.raises(ValueError, match="0-d"): tf.read("scalar", slice(0, 1))
    with pytest.raises(KeyError, match="no tensor 'nope'"): tf.read("nope")
    with pytest.raises(TypeError): tf.read("w", 1)


def test_parameters_with_attributes(tmp_path):
    "Parameters and tensors that carry Python attributes use other rebuild functions."
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.randn(3, 2)); p.extra = "x"
    t = torch.randn(2, 2); t.note = 1
    sd = {"p": p, "t": t}
    torch.save(sd, tmp_path / "a.bin")
    with zipfile.ZipFile(tmp_path / "a.bin") as z:
        pkl = z.read("a/data.pkl")
    assert b"_rebuild_parameter_with_state" in pkl and b"_rebuild_from_type_v2" in pkl
    _check_all(tmp_path / "a.bin", sd)


def test_module_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=100, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    sd = transformers.GPTJForCausalLM(cfg).to(torch.bfloat16).state_dict()   # an OrderedDict with `_metadata`
    assert hasattr(sd, "_metadata")
    torch.save(sd, tmp_path / "pytorch_model.bin")
    tf = _check_all(tmp_path / "pytorch_model.bin", sd)
    assert tf.shapes["transformer.h.1.mlp.fc_in.weight"] == (256, 64)


def test_big_endian(tmp_path):
    "A file whose byteorder member says `big`: the storages (rewritten here byte-swapped) read as the same values."
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    sd = {"f32": torch.randn(4, 3), "bf16": torch.randn(3, 2).bfloat16(), "i64": torch.arange(-4, 4).view(2, 4),
          "c64": torch.randn(3, dtype=torch.complex64), "bool": torch.tensor([True, False]), "t": torch.randn(3, 5).t()}
    torch.save(sd, tmp_path / "le.bin")
    tf = TorchFile(tmp_path / "le.bin")
    prefix, members = _members(tmp_path / "le.bin")
    for k, t in tf._t.items():
        raw = np.frombuffer(members[f"data/{t.storage.key}"], t.dtype).copy()
        torchfile._swap_bytes(raw)
        members[f"data/{t.storage.key}"] = raw.tobytes()
    members["byteorder"] = b"big"
    _check_all(_zip(tmp_path / "be.bin", members, prefix), sd)


def test_reads_only_the_rows(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.randn(100, 64), "t": torch.randn(64, 100).t()}, tmp_path / "r.bin")
    tf, asked = TorchFile(tmp_path / "r.bin"), []
    real = torchfile.pread_into
    monkeypatch.setattr(torchfile, "pread_into", lambda fn, pos, buf: (asked.append(buf.nbytes), real(fn, pos, buf)))
    tf.read("w", slice(10, 13))
    assert asked == [3 * 64 * 4]
    asked.clear(); tf.read("t", slice(0, 2))   # rows of a transposed view: the span of storage they cover
    assert asked == [(63 * 100 + 1 + 1) * 4]


def test_zip64_local_header(tmp_path):
    "A member with a zip64 extra field in its local header (as in files over 4 GB) is found all the same."
    data = np.arange(12, dtype=np.float32)
    pkl = _pickle({"w": Call(REBUILD_V2, Persistent(("storage", FLOAT, "0", "cpu", 12)), 0, (3, 4), (4, 1), False, HOOKS)})
    fn = tmp_path / "z64.bin"
    with zipfile.ZipFile(fn, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        with z.open("archive/data/0", "w", force_zip64=True) as f: f.write(data.tobytes())
    with zipfile.ZipFile(fn) as z: assert len(z.getinfo("archive/data/0").extra) == 0   # the central copy has none
    np.testing.assert_array_equal(TorchFile(fn).read("w"), data.reshape(3, 4))


# ---- refusals -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload", ["reduce", "eval", "stack_global", "nested", "build"])
def test_malicious_pickle_refused(tmp_path, payload):
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}"
    if payload == "reduce":      # the usual trick: an object whose __reduce__ calls os.system
        pkl = _pickle({"w": Call(os.system, cmd)})
    elif payload == "eval":
        pkl = _pickle({"w": Call(eval, f"__import__('os').system({cmd!r})")})
    elif payload == "stack_global":   # protocol 4 names globals differently (STACK_GLOBAL)
        pkl = pickle.dumps({"w": Call(os.system, cmd)}, protocol=4)
    elif payload == "nested":    # the call hides inside an allowed one's arguments
        pkl = _pickle({"w": Call(collections.OrderedDict, [("a", Call(os.system, cmd))])})
    else:                        # BUILD on an allowed OrderedDict, with state that would run code (protocol 0 opcodes)
        pkl = b"ccollections\nOrderedDict\n)R}S'x'\ncposix\nsystem\n(S'" + cmd.encode() + b"'\ntRsb."
    fn = _zip(tmp_path / "evil.bin", {"data.pkl": pkl, "data/0": b"\0" * 16})
    with pytest.raises(ValueError) as e: TorchFile(fn)
    msg = str(e.value)
    assert str(fn) in msg
    assert "refused the global" in msg and ("system" in msg or "eval" in msg), msg
    assert not marker.exists()


def test_malicious_data_pkl_in_a_real_file(tmp_path):
    "A real torch file whose data.pkl was swapped for one that runs a command."
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3)}, tmp_path / "real.bin")
    prefix, members = _members(tmp_path / "real.bin")
    marker = tmp_path / "pwned"
    members["data.pkl"] = _pickle({"w": Call(os.system, f"touch {marker}")})
    fn = _zip(tmp_path / "evil.bin", members, prefix)
    with pytest.raises(ValueError, match=r"evil\.bin: refused the global 'posix\.system'"): TorchFile(fn)
    assert not marker.exists()


def test_not_a_dict_of_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.bin")
    with pytest.raises(ValueError, match="refused the global 'torch.nn.modules.linear.Linear'"): TorchFile(tmp_path / "module.bin")
    torch.save([torch.ones(2)], tmp_path / "list.bin")
    with pytest.raises(ValueError, match=r"list\.bin holds a list, not a dict of tensors"): TorchFile(tmp_path / "list.bin")
    torch.save({"model": {"w": torch.ones(2)}, "step": 1}, tmp_path / "ckpt.bin")
    with pytest.raises(ValueError, match="'model' is a dict, not a tensor.*training checkpoint"): TorchFile(tmp_path / "ckpt.bin")
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "int.bin")
    with pytest.raises(ValueError, match="'step' is a int, not a tensor"): TorchFile(tmp_path / "int.bin")
    torch.save({1: torch.ones(2)}, tmp_path / "key.bin")
    with pytest.raises(ValueError, match="the key 1 is not a tensor name"): TorchFile(tmp_path / "key.bin")


def test_legacy_and_other_formats(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError) as e: TorchFile(tmp_path / "old.bin")
    msg = str(e.value)
    assert str(tmp_path / "old.bin") in msg and "legacy (non-zip) format" in msg
    assert "cannot read safely without torch" in msg and "safetensors" in msg and "re-save" in msg.lower()
    (tmp_path / "bare.pkl").write_bytes(pickle.dumps({"w": [1.0]}))
    with pytest.raises(ValueError, match="legacy"): TorchFile(tmp_path / "bare.pkl")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"): TorchFile(tmp_path / "empty.bin")
    (tmp_path / "lfs.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "a" * 5000)
    with pytest.raises(ValueError, match="not a PyTorch checkpoint") as e: TorchFile(tmp_path / "lfs.bin")
    assert len(str(e.value)) < 400
    _zip(tmp_path / "other.zip", {"readme.txt": b"hi"})
    with pytest.raises(ValueError, match="0 data.pkl members"): TorchFile(tmp_path / "other.zip")
    with warnings.catch_warnings():   # torch.jit is deprecated, but such files exist
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "script.pt")
    with pytest.raises(ValueError, match="TorchScript archive"): TorchFile(tmp_path / "script.pt")


# ---- damage -------------------------------------------------------------------------------------------------

def test_truncated(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "ok.bin")
    raw = (tmp_path / "ok.bin").read_bytes()
    for n in (10, 2000, len(raw) // 2, len(raw) - 10):
        (tmp_path / "cut.bin").write_bytes(raw[:n])
        with pytest.raises(ValueError, match=rf"{tmp_path / 'cut.bin'} is a truncated or damaged zip"): TorchFile(tmp_path / "cut.bin")


def test_damaged(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.randn(8, 8), "v": torch.randn(3)}, tmp_path / "ok.bin")
    tf, raw = TorchFile(tmp_path / "ok.bin"), (tmp_path / "ok.bin").read_bytes()
    prefix, members = _members(tmp_path / "ok.bin")
    # a missing storage member
    key = tf._t["v"].storage.key
    gone = {k: v for k, v in members.items() if k != f"data/{key}"}
    with pytest.raises(ValueError, match=rf"missing\.bin has no member '{prefix}/data/{key}'"):
        TorchFile(_zip(tmp_path / "missing.bin", gone, prefix))
    # a storage shorter than its tensor
    short = {**members, f"data/{key}": members[f"data/{key}"][:8]}
    with pytest.raises(ValueError, match="tensor 'v' needs 12 bytes of storage '1', which has 8"):
        TorchFile(_zip(tmp_path / "short.bin", short, prefix))
    # a damaged local header, and a damaged pickle (its CRC no longer matches)
    with zipfile.ZipFile(tmp_path / "ok.bin") as z:
        off, pkl_off = z.getinfo(f"{prefix}/data/{key}").header_offset, z.getinfo(f"{prefix}/data.pkl").header_offset
    bad = bytearray(raw); bad[off:off + 4] = b"XXXX"
    (tmp_path / "hdr.bin").write_bytes(bad)
    with pytest.raises(ValueError, match=rf"hdr\.bin: the zip header of '{prefix}/data/{key}' is damaged"): TorchFile(tmp_path / "hdr.bin")
    bad = bytearray(raw); bad[pkl_off + 100] ^= 0xFF
    (tmp_path / "pkl.bin").write_bytes(bad)
    with pytest.raises(ValueError, match=r"pkl\.bin: cannot read .*data\.pkl.*damaged"): TorchFile(tmp_path / "pkl.bin")
    # a compressed member (torch never writes one)
    with zipfile.ZipFile(tmp_path / "deflated.bin", "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in members.items(): z.writestr(f"{prefix}/{k}", v)
    with pytest.raises(ValueError, match="is compressed or encrypted"): TorchFile(tmp_path / "deflated.bin")
    # an unknown byteorder
    with pytest.raises(ValueError, match="unknown byteorder b'middle'"):
        TorchFile(_zip(tmp_path / "bo.bin", {**members, "byteorder": b"middle"}, prefix))
    # a file cut after TorchFile was made: read names it
    (tmp_path / "late.bin").write_bytes(raw)
    late = TorchFile(tmp_path / "late.bin")
    os.truncate(tmp_path / "late.bin", late._where[late._t["w"].storage.key][0] + 10)
    with pytest.raises(ValueError, match=r"late\.bin ends at byte .* the file is truncated"): late.read("w")


def test_unknown_storage_type_and_odd_pickles(tmp_path):
    "Pickles that name only allowed globals but describe something wrong or unsupported."
    def file(obj, name):
        return _zip(tmp_path / name, {"data.pkl": _pickle(obj), "data/0": b"\0" * 64})
    def tensor(storage_type=FLOAT, shape=(4,), stride=(1,), offset=0, metadata=None, rebuild=REBUILD_V2):
        pid = Persistent(("storage", storage_type, "0", "cpu", 4))
        return Call(rebuild, pid, offset, shape, stride, False, HOOKS, *([] if metadata is None else [metadata]))
    np.testing.assert_array_equal(TorchFile(file({"w": tensor()}, "ok.bin")).read("w"), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"q\.bin: unknown storage type torch\.QInt8Storage"):
        TorchFile(file({"w": tensor(Global("torch", "QInt8Storage"))}, "q.bin"))
    with pytest.raises(ValueError, match=r"unknown storage type torch\.float32"):
        TorchFile(file({"w": tensor(Global("torch", "float32"))}, "dt.bin"))
    with pytest.raises(ValueError, match="refused the global 'torch.cuda.FloatStorage'"):
        TorchFile(file({"w": tensor(Global("torch.cuda", "FloatStorage"))}, "cuda.bin"))
    with pytest.raises(ValueError, match="shape \\(4,\\) but strides \\(1, 1\\)"):
        TorchFile(file({"w": tensor(stride=(1, 1))}, "st.bin"))
    with pytest.raises(ValueError, match="shape is \\(-4,\\)"):
        TorchFile(file({"w": tensor(shape=(-4,))}, "neg.bin"))
    with pytest.raises(ValueError, match="storage offset is \\(True,\\)"):
        TorchFile(file({"w": tensor(offset=True)}, "bool.bin"))
    with pytest.raises(ValueError, match="unsupported tensor metadata"):
        TorchFile(file({"w": tensor(metadata={"zero": True})}, "md.bin"))
    with pytest.raises(ValueError, match="needs 68 bytes"):   # reaches past its storage
        TorchFile(file({"w": tensor(shape=(17,))}, "far.bin"))
    with pytest.raises(ValueError, match="unexpected persistent id"):
        TorchFile(file({"w": Persistent(("module", "x"))}, "pid.bin"))
    with pytest.raises(ValueError, match="not a storage"):
        TorchFile(file({"w": Call(REBUILD_V2, "data/0", 0, (4,), (1,), False, HOOKS)}, "nostorage.bin"))
    with pytest.raises(ValueError, match="data.pkl is damaged or not a plain state dict .*TypeError"):   # a marker is not callable
        TorchFile(file({"w": Call(FLOAT, 4)}, "call.bin"))
    # the v3 rebuild takes a dtype; a uint16 tensor over an untyped (byte) storage, at an offset of 1 element
    v3 = Call(Global("torch._utils", "_rebuild_tensor_v3"), Persistent(("storage", Global("torch.storage", "UntypedStorage"), "0", "cpu", 64)),
              1, (2,), (1,), False, HOOKS, Global("torch", "uint16"))
    fn = _zip(tmp_path / "v3.bin", {"data.pkl": _pickle({"u": v3}), "data/0": np.array([7, 8, 9], "<u2").tobytes()})
    np.testing.assert_array_equal(TorchFile(fn).read("u"), np.array([8, 9], np.uint16))
    # BUILD on a rebuilt tensor (to change its shape after the checks) is refused; on a state dict, ignored
    build = CallThenBuild(REBUILD_V2, tensor().args, {"shape": (1000,)})
    with pytest.raises(ValueError, match="tries to modify a tensor"): TorchFile(file({"w": build}, "build.bin"))
    sd = CallThenBuild(Global("collections", "OrderedDict"), (), {"_metadata": {"": {"version": 1}}})
    pkl = _pickle(sd)[:-1] + b"X\x01\x00\x00\x00w" + _pickle(tensor())[2:-1] + b"s."
    fn = _zip(tmp_path / "meta.bin", {"data.pkl": pkl, "data/0": b"\0" * 16})
    assert TorchFile(fn).shapes == {"w": (4,)}
    # long contents are quoted short
    with pytest.raises(ValueError) as e:
        TorchFile(file({"w": Persistent(("storage", "x" * 100000, "0", "cpu", 4))}, "long.bin"))
    assert len(str(e.value)) < 500


def test_no_torch_import():
    "The module reads files without torch: it never imports it (checked in a fresh interpreter)."
    code = (f"import sys, types; pkg = types.ModuleType('meshtx'); pkg.__path__ = [{str(MODULE_FILE.parent)!r}]; "
            "sys.modules['meshtx'] = pkg; import meshtx.torchfile; print('torch' in sys.modules)")   # without meshtx/__init__
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    assert "import torch" not in MODULE_FILE.read_text()


# ---- memory -------------------------------------------------------------------------------------------------

_STREAM = """
import hashlib, importlib.util, json, re, sys
def peak_kb():   # the kernel's high-water mark of this process's resident memory (unlike ru_maxrss, fresh after exec)
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1])
import os, types   # torchfile and the storage module it uses, without meshtx/__init__ (and so without jax)
pkg = types.ModuleType("meshtx"); pkg.__path__ = [os.path.dirname(sys.argv[1])]; sys.modules["meshtx"] = pkg
import meshtx.torchfile as m
import numpy as np
tf = m.TorchFile(sys.argv[2]); n = tf.shapes["big"][0]; step = int(sys.argv[3]); h = hashlib.sha256()
base = peak_kb()
for r in range(0, n, step): h.update(tf.read("big", slice(r, r + step)))
print(json.dumps({"grew_kb": peak_kb() - base, "sha": h.hexdigest(), "torch": "torch" in sys.modules}))
"""


def _stream(fn, step) -> dict:
    "Read tensor 'big' of `fn` in chunks of `step` rows in a fresh process: its peak memory growth and the data's hash."
    out = subprocess.run([sys.executable, "-c", _STREAM, str(MODULE_FILE), str(fn), str(step)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak memory is read from Linux's /proc")
def test_streaming_memory(tmp_path):
    "Reading a ~200 MB float32 tensor in row chunks grows peak memory by about a chunk, not by the tensor."
    torch = pytest.importorskip("torch")
    rows, cols, step = 12800, 4096, 256                         # 210 MB; chunks of 4.2 MB
    a = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    torch.save({"big": torch.from_numpy(a)}, tmp_path / "big.bin")
    sha, nbytes = hashlib.sha256(a).hexdigest(), a.nbytes
    del a
    r = _stream(tmp_path / "big.bin", step)
    chunk = step * cols * 4
    print(f"peak grew by {r['grew_kb'] / 1024:.1f} MB reading a {nbytes / 2**20:.0f} MB tensor in {chunk / 2**20:.1f} MB chunks")
    assert r["sha"] == sha and not r["torch"]
    assert r["grew_kb"] * 1024 < 3 * chunk + (4 << 20), (r["grew_kb"], chunk, nbytes)
    whole = _stream(tmp_path / "big.bin", rows)   # the same measurement sees a whole read: one copy of the tensor
    print(f"peak grew by {whole['grew_kb'] / 1024:.1f} MB reading it whole")
    assert whole["sha"] == sha and 0.9 * nbytes < whole["grew_kb"] * 1024 < 1.2 * nbytes


def test_a_compressed_data_pkl_is_refused_before_it_is_inflated(tmp_path):
    "torch.save stores members as they are: a deflated data.pkl (a zip bomb: KB that inflate to GB) is not read."
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3)}, tmp_path / "real.bin")
    prefix, members = _members(tmp_path / "real.bin")
    members["data.pkl"] = pickle.dumps({}, protocol=2)[:-1] + b"N" * (1 << 20) + b"0" * (1 << 20) + b"."   # inflates to 2 MB
    with zipfile.ZipFile(tmp_path / "bomb.bin", "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(f"{prefix}/{name}", data, compress_type=zipfile.ZIP_DEFLATED if name == "data.pkl" else zipfile.ZIP_STORED)
    assert (tmp_path / "bomb.bin").stat().st_size < 100_000
    with pytest.raises(ValueError, match=r"bomb\.bin: member '.*data\.pkl' is compressed"): TorchFile(tmp_path / "bomb.bin")


def test_the_legacy_fallback_is_chosen_by_the_file_not_by_a_word_in_a_message(tmp_path):
    "A damaged zip in a folder named 'legacy_models' is reported as a damaged zip, not handed to torch.load."
    torch = pytest.importorskip("torch")
    from meshtx.weights import _torch_file
    (tmp_path / "legacy_models").mkdir()
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "ok.bin")
    (tmp_path / "legacy_models" / "cut.bin").write_bytes((tmp_path / "ok.bin").read_bytes()[:2000])
    with pytest.raises(ValueError, match="is a truncated or damaged zip"): _torch_file(tmp_path / "legacy_models" / "cut.bin")
    torch.save({"w": torch.ones(3)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    assert _torch_file(tmp_path / "old.bin").shapes == {"w": (3,)}   # torch's legacy format: torch.load(weights_only=True)
