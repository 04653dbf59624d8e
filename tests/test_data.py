"""meshtx.data: documents -> packed token files -> batches; TFRecords read without TensorFlow; local and gs://."""
import gzip, json, os, struct
from pathlib import Path

import numpy as np
import numpy.testing as npt
import pytest
import zstandard

from meshtx.data import Loader, TokenData, prepare_data, read_documents, read_tfrecord, windows_from_tokens
from meshtx.storage import filesystem
from meshtx.tokenizer import ByteTokenizer, gpt2_tokenizer


class Numbers:
    "A test tokenizer: a document is whitespace-separated integers, which are its tokens; EOT is 0."
    eos_token_id = 0
    def __init__(self, vocab=1 << 20): self.vocab = vocab
    def __len__(self): return self.vocab
    def encode(self, text): return [int(t) for t in text.split()]


def byte_stream(docs):
    return np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int64), 256) for d in docs])


def make_corpus(root: Path) -> list:
    "A folder with every supported text format; returns its documents in the order they must be read."
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha one<|endoftext|>beta two<|endoftext|>")
    (root / "b.jsonl").write_text('{"text": "gamma \\u00e9t\\u00e9"}\n\n{"text": "delta", "meta": {"x": 1}}\n')
    (root / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "epsilon"}\n{"text": "zeta eta"}\n'))
    (root / "sub" / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("theta – ünïcode".encode()))
    (root / "sub" / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "iota"}\n'))
    (root / ".hidden.txt").write_text("never read")
    (root / ".cache").mkdir(); (root / ".cache" / "x.txt").write_text("never read")
    return ["alpha one", "beta two", "gamma été", "delta", "epsilon", "zeta eta", "theta – ünïcode", "iota"]


# ---------------------------------------------------------------- documents and packing

def test_formats_and_folders_byte_tokenizer(tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    assert list(read_documents(tmp_path / "corpus")) == docs
    assert list(read_documents([tmp_path / "corpus" / "b.jsonl", tmp_path / "corpus" / "a.txt"])) == docs[2:4] + docs[:2]
    data = prepare_data(tmp_path / "corpus", tmp_path / "out", ByteTokenizer(), seq=7, progress=False)
    stream = byte_stream(docs)
    expected = windows_from_tokens(stream, 7)
    npt.assert_array_equal(data.windows(range(len(expected))), expected)
    raw = np.fromfile(tmp_path / "out" / "tokens.bin", "<u2")            # the file itself: plain uint16 LE
    npt.assert_array_equal(raw, expected.reshape(-1))
    h = json.loads((tmp_path / "out" / "header.json").read_text())
    assert h["format"] == "meshtx-tokens" and h["version"] == 1
    assert (h["tokenizer"], h["vocab_size"], h["eot_id"], h["seq"], h["dtype"]) == ("ByteTokenizer", 257, 256, 7, "uint16")
    assert (h["n_documents"], h["n_tokens"], h["n_windows"], h["n_val_windows"]) == (8, len(stream), len(expected), 0)
    assert h["dropped_tokens"] == len(stream) % 8 and h["replaced_bytes"] == 0 and h["n_files"] == 5
    assert h["sources"] == [str(tmp_path / "corpus")]
    assert data.windows([0]).dtype == np.int32 and data.n("train") == len(expected) and data.n("val") == 0
    # a string names the tokenizer, too
    again = prepare_data(tmp_path / "corpus", tmp_path / "out2", "bytes", seq=7, progress=False)
    npt.assert_array_equal(again.windows(range(len(expected))), expected)
    assert again.header["tokenizer"] == "bytes"


def test_gpt2_tokenizer_eot_between_documents(tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    tok = gpt2_tokenizer()
    stream = np.concatenate([tok.encode(d) + [50256] for d in docs])
    assert stream.tolist()[:3] == [26591, 530, 50256]        # "alpha one" <|endoftext|>
    data = prepare_data(tmp_path / "corpus", tmp_path / "out", tok, seq=5, progress=False)
    npt.assert_array_equal(data.windows(range(data.n())), windows_from_tokens(stream, 5))
    assert (data.header["vocab_size"], data.header["eot_id"], data.header["dtype"]) == (50257, 50256, "uint16")
    named = prepare_data(tmp_path / "corpus", tmp_path / "named", "gpt2", seq=5, progress=False)
    npt.assert_array_equal(named.windows(range(named.n())), data.windows(range(data.n())))


def test_large_vocabulary_is_uint32(tmp_path):
    (tmp_path / "n.txt").write_text("70000 65536 1 2 3 99999")
    data = prepare_data(tmp_path / "n.txt", tmp_path / "out", Numbers(100_000), seq=6, progress=False)
    assert data.header["dtype"] == "uint32"
    npt.assert_array_equal(data.windows([0]), [[70000, 65536, 1, 2, 3, 99999, 0]])
    with pytest.raises(ValueError, match=r"n.txt: token 70000 is outside the vocabulary \(0 to 999\)"):
        prepare_data(tmp_path / "n.txt", tmp_path / "bad", Numbers(1000), seq=2, progress=False)


def test_bad_bytes_replaced_counted_and_warned(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_bytes(b"ok \xff\xfe bytes<|endoftext|>caf\xc3")   # 2 bad bytes + a cut-off é
    (tmp_path / "c" / "b.jsonl").write_bytes(b'{"text": "x\xe9y"}\n')                 # latin-1 é
    (tmp_path / "c" / "empty.txt").write_bytes(b"")
    with pytest.warns(UserWarning) as caught:
        data = prepare_data(tmp_path / "c", tmp_path / "out", ByteTokenizer(), seq=3, progress=False)
    messages = [str(w.message) for w in caught]
    assert any("a.txt: 3 bytes that are not UTF-8" in m for m in messages), messages
    assert any("b.jsonl: 1 bytes that are not UTF-8" in m for m in messages), messages
    assert any("empty.txt: empty" in m and "skipped" in m for m in messages), messages
    assert data.header["replaced_bytes"] == 4 and data.header["n_documents"] == 3
    expected = byte_stream(["ok \ufffd\ufffd bytes", "caf\ufffd", "x\ufffdy"])
    npt.assert_array_equal(data.windows(range(data.n())), windows_from_tokens(expected, 3))


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
    cases = {'{"text": "a"}\n\n{"text": "b"\n': r"bad.jsonl, line 3: not JSON",
             '{"text": "a"}\n{"body": "b"}\n': r'bad.jsonl, line 2: needs a string "text" field \(no text field\)',
             '{"text": 5}\n': r'bad.jsonl, line 1: needs a string "text" field \(text = 5\)',
             '["text"]\n': r"bad.jsonl, line 1: needs a string"}
    for content, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(content)
        with pytest.raises(ValueError, match=message):
            list(read_documents(tmp_path / "bad.jsonl"))
        with pytest.raises(ValueError, match=message):
            prepare_data(tmp_path / "bad.jsonl", tmp_path / "out", ByteTokenizer(), seq=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        list(read_documents(tmp_path / "nope.txt"))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.warns(UserWarning, match="blank.txt: empty"), pytest.raises(ValueError, match="no documents"):
        list(read_documents(tmp_path / "blank.txt"))


def test_too_little_data_writes_nothing(tmp_path):
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match=r"4 tokens, and one window needs seq \+ 1 = 9"):
        prepare_data(tmp_path / "short.txt", tmp_path / "out", ByteTokenizer(), seq=8, progress=False)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]      # no staging folder left behind


def test_rewrite_replaces_and_failure_keeps_the_old_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("0123456789")
    (tmp_path / "b.txt").write_text("abcdefghijklmnopqrst")
    prepare_data(tmp_path / "a.txt", tmp_path / "out", ByteTokenizer(), seq=4, progress=False)
    with pytest.raises(ValueError):
        prepare_data(tmp_path / "b.txt", tmp_path / "out", ByteTokenizer(), seq=100, progress=False)
    assert TokenData.open(tmp_path / "out").n() == 2                          # untouched
    new = prepare_data(tmp_path / "b.txt", tmp_path / "out", ByteTokenizer(), seq=4, progress=False)
    assert new.n() == 4 and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["header.json", "tokens.bin"]
    (tmp_path / "out" / "header.json").unlink()
    with pytest.raises(FileNotFoundError, match="no header.json"):
        TokenData.open(tmp_path / "out")


KILLED_PUBLISH = """
import os, sys, signal
from meshtx.data import prepare_data
from meshtx.tokenizer import ByteTokenizer
src, out, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = []
def hook(ev, args):
    if ev in ("os.rename", "os.remove", "os.unlink", "shutil.move") and out in " ".join(map(str, args[:2])):
        seen.append(ev)
        if len(seen) == nth: os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
prepare_data(src, out, ByteTokenizer(), seq=4, progress=False)
"""


def test_publish_killed_at_every_step_leaves_a_dataset(tmp_path):
    """prepare_data over an earlier dataset, killed (SIGKILL) before each of its file-system steps in the output folder:
    the folder then opens as the earlier dataset or the new one (an interrupted publish is completed), never neither."""
    import subprocess, sys
    (tmp_path / "a.txt").write_text("0123456789")                 # 2 windows
    (tmp_path / "b.txt").write_text("abcdefghijklmnopqrst")       # 4 windows
    out = tmp_path / "out"
    seen, nth = set(), 1
    while True:
        prepare_data(tmp_path / "a.txt", out, ByteTokenizer(), seq=4, progress=False)
        r = subprocess.run([sys.executable, "-c", KILLED_PUBLISH, str(tmp_path / "b.txt"), str(out), str(nth)], timeout=120)
        n = TokenData.open(out).n()
        assert n in (2, 4), n
        seen.add(n)
        if r.returncode == 0: break
        assert r.returncode == -9, r.returncode
        nth += 1
    assert nth >= 4 and seen == {2, 4}    # several kill points, some before the switch and some after
    prepare_data(tmp_path / "b.txt", out, ByteTokenizer(), seq=4, progress=False)
    assert TokenData.open(out).n() == 4


# ---------------------------------------------------------------- validation split and loader

@pytest.fixture
def numbered(tmp_path):
    "40 windows of 3 + 1 tokens, each unique (tokens 1..159, then EOT 0), 25% held out for validation."
    (tmp_path / "n.txt").write_text(" ".join(str(i) for i in range(1, 160)))
    return prepare_data(tmp_path / "n.txt", tmp_path / "out", Numbers(), seq=3, val_fraction=0.25, seed=3, progress=False)


def rows(batches):
    return [tuple(r) for b in batches for r in np.asarray(b).reshape(-1, np.asarray(b).shape[-1])]


def test_val_split_is_seeded_whole_windows_never_in_train(tmp_path, numbered):
    assert (numbered.n("train"), numbered.n("val")) == (30, 10)
    train, val = rows([numbered.windows(range(30))]), rows([numbered.windows(range(10), "val")])
    everything = rows([windows_from_tokens(np.append(np.arange(1, 160), 0), 3)])
    assert set(train) | set(val) == set(everything) and not set(train) & set(val) and len(set(train)) == 30
    assert val == sorted(val)                                               # validation windows keep their order
    same = prepare_data(tmp_path / "n.txt", tmp_path / "same", Numbers(), seq=3, val_fraction=0.25, seed=3, progress=False)
    other = prepare_data(tmp_path / "n.txt", tmp_path / "other", Numbers(), seq=3, val_fraction=0.25, seed=4, progress=False)
    assert rows([same.windows(range(10), "val")]) == val
    assert rows([other.windows(range(10), "val")]) != val
    # and through loaders, over several epochs
    seen = rows(b for b, _ in zip(Loader(numbered, 4, 2, process_index=0, process_count=1), range(20)))
    assert not set(seen) & set(val)
    with pytest.raises(IndexError, match="window 10 of the val split"):
        numbered.windows([10], "val")


def test_loader_deterministic_shuffled_every_window_once_per_epoch(numbered):
    make = lambda seed: Loader(numbered, batch=4, accum=2, seed=seed, process_index=0, process_count=1)
    first = [b for b, _ in zip(make(0), range(15))]                        # 15 × 8 = 120 windows = 4 epochs of 30
    assert first[0].shape == (2, 4, 4) and first[0].dtype == np.int32
    again = [b for b, _ in zip(make(0), range(15))]
    other = [b for b, _ in zip(make(1), range(15))]
    npt.assert_array_equal(np.stack(first), np.stack(again))
    assert not np.array_equal(np.stack(first), np.stack(other))
    stream = rows(first)
    train = set(rows([numbered.windows(range(30))]))
    epochs = [stream[i:i + 30] for i in range(0, 120, 30)]
    for epoch in epochs:
        assert len(set(epoch)) == 30 and set(epoch) == train               # every window exactly once, batches spanning epochs
    assert epochs[0] != epochs[1]                                          # reshuffled each epoch
    assert len(make(0)) == 4                                               # ceil(30 / 8) batches cover an epoch


def test_loader_resume_from_state(numbered):
    for stop in (0, 3, 4, 7):                                              # 4 is inside an epoch boundary batch
        a = Loader(numbered, 4, 2, seed=9, process_index=0, process_count=1)
        ia = iter(a)
        for _ in range(stop): next(ia)
        state = json.loads(json.dumps(a.state()))
        assert state["position"] == stop
        b = Loader(numbered, 4, 2, process_index=0, process_count=1, state=state)   # seed comes from the state
        ib = iter(b)
        for _ in range(6): npt.assert_array_equal(next(ia), next(ib))
        c = Loader(numbered, 4, 2, process_index=0, process_count=1)
        c.load_state(state)
        npt.assert_array_equal(next(iter(c)), b.batch_at(stop))
    with pytest.raises(ValueError, match="loader state: batch was 4, now 8"):
        Loader(numbered, 8, 2, process_index=0, process_count=1, state=state)


def test_two_processes_make_the_global_batch(numbered):
    one = Loader(numbered, 4, 3, seed=2, process_index=0, process_count=1)
    two = [Loader(numbered, 4, 3, seed=2, process_index=i, process_count=2) for i in range(2)]
    for g, p0, p1, _ in zip(one, *two, range(7)):
        assert p0.shape == (3, 2, 4)
        npt.assert_array_equal(np.concatenate([p0, p1], axis=1), g)
    # a state taken with one process resumes onto two
    resumed = [Loader(numbered, 4, 3, process_index=i, process_count=2, state=one.state()) for i in range(2)]
    npt.assert_array_equal(np.concatenate([next(iter(r)) for r in resumed], axis=1), next(iter(one)))
    with pytest.raises(ValueError, match="batch=4 does not divide over process_count=3"):
        Loader(numbered, 4, process_index=0, process_count=3)
    default = Loader(numbered, 4, 3, seed=2)                               # jax.process_index() / process_count()
    assert (default.rows.start, default.rows.stop) == (0, 4)
    npt.assert_array_equal(default.batch_at(5), one.batch_at(5))


def test_val_loader_is_finite_ordered_and_reiterable(numbered):
    val = Loader(numbered, 3, split="val", process_index=0, process_count=1)
    assert len(val) == 3                                                   # 10 windows: 3 batches, 1 dropped
    passes = [list(val), list(val)]
    assert len(passes[0]) == 3
    npt.assert_array_equal(np.stack(passes[0]), np.stack(passes[1]))
    npt.assert_array_equal(np.concatenate([b[0] for b in passes[0]]), numbered.windows(range(9), "val"))
    with pytest.raises(ValueError, match="has 10 windows; one batch needs batch × accum = 12"):
        Loader(numbered, 4, 3, split="val", process_index=0, process_count=1)


# ---------------------------------------------------------------- TFRecords, written here by hand

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1                                                     # int64 two's complement
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n: return bytes(out)


def field(number: int, payload: bytes) -> bytes:                           # a length-delimited field (wire type 2)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def example(features: dict) -> bytes:
    "tf.train.Example{features{feature{name: Feature}}}; int lists packed (as TensorFlow writes them), bytes as BytesList."
    entries = b""
    for name, value in features.items():
        if isinstance(value, bytes): feature = field(1, field(1, value))                           # bytes_list
        else: feature = field(3, field(1, b"".join(varint(int(v)) for v in value)))                # int64_list, packed
        entries += field(1, field(1, name.encode()) + field(2, feature))
    return field(1, entries)


def crc32c_masked(data: bytes) -> int:
    import google_crc32c
    crc = google_crc32c.value(data)
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) % (1 << 32)


def tfrecord(records) -> bytes:
    out = b""
    for data in records:
        length = struct.pack("<Q", len(data))
        out += length + struct.pack("<I", crc32c_masked(length)) + data + struct.pack("<I", crc32c_masked(data))
    return out


def test_crc32c_check_value():
    import google_crc32c
    assert google_crc32c.value(b"123456789") == 0xE3069283


def test_tfrecord_roundtrip_and_corruption(tmp_path):
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 50257, 2049) for _ in range(3)]
    records = [example({"meta": b"x", "text": t}) for t in tokens]
    # a record with the unpacked encoding (one varint per value) reads the same
    unpacked = field(1, field(1, field(1, b"text") + field(2, field(3, b"".join(b"\x08" + varint(v) for v in [7, 300, 50256])))))
    path = tmp_path / "data.tfrecords"
    path.write_bytes(tfrecord(records + [unpacked]))
    got = list(read_tfrecord(path))
    assert len(got) == 4
    for g, t in zip(got, tokens): npt.assert_array_equal(g, t)
    npt.assert_array_equal(got[3], [7, 300, 50256])
    # a flipped byte in the second record's data, in its length, then a truncated file
    blob = bytearray(path.read_bytes())
    second = len(records[0]) + 16
    for offset, problem in [(second + 12 + 100, "corrupt data"), (second + 2, "corrupt length"), (None, "truncated")]:
        bad = bytearray(blob)
        if offset is None: bad = bad[:second + 40]
        else: bad[offset] ^= 0x01
        (tmp_path / "bad.tfrecords").write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=rf"bad.tfrecords, record 2 \(byte {second}\): {problem}"):
            list(read_tfrecord(tmp_path / "bad.tfrecords"))
    (tmp_path / "nofeature.tfrecords").write_bytes(tfrecord([example({"other": [1, 2]})]))
    with pytest.raises(ValueError, match=r'nofeature.tfrecords, record 1 \(byte 0\): no feature "text"'):
        list(read_tfrecord(tmp_path / "nofeature.tfrecords"))


def test_prepare_data_from_tfrecords(tmp_path):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 50257, 2049) for _ in range(3)]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.tfrecords").write_bytes(tfrecord([example({"text": t}) for t in tokens[:2]]))
    (tmp_path / "src" / "b.tfrecords").write_bytes(tfrecord([example({"text": tokens[2]})]))
    data = prepare_data(tmp_path / "src", tmp_path / "out", gpt2_tokenizer(), seq=2048, progress=False)
    npt.assert_array_equal(data.windows(range(3)), np.stack(tokens))      # the original's 2049-token records, as they were
    assert (data.header["n_records"], data.header["n_documents"], data.header["n_windows"]) == (3, 0, 3)
    repacked = prepare_data(tmp_path / "src", tmp_path / "out2", gpt2_tokenizer(), seq=999, progress=False)
    npt.assert_array_equal(repacked.windows(range(6)), windows_from_tokens(np.concatenate(tokens), 999))
    with pytest.raises(ValueError, match="TFRecord file holds tokens"):
        list(read_documents(tmp_path / "src"))


# ---------------------------------------------------------------- gs:// (a real GCS emulator)

def test_gcs_prepare_open_and_load_like_local(tmp_path, gcs_bucket):
    lines = "".join(json.dumps({"text": f"document number {i} " * (i % 5 + 1)}) + "\n" for i in range(60))
    (tmp_path / "docs.jsonl").write_text(lines)
    fs, root = filesystem(gcs_bucket)
    fs.pipe_file(f"{root}/src/docs.jsonl", lines.encode())
    prepare_data(f"{gcs_bucket}/src", f"{gcs_bucket}/ds", ByteTokenizer(), seq=16, val_fraction=0.1, progress=False)
    local = prepare_data(tmp_path / "docs.jsonl", tmp_path / "ds", ByteTokenizer(), seq=16, val_fraction=0.1, progress=False)
    assert fs.exists(f"{root}/ds/header.json") and fs.size(f"{root}/ds/tokens.bin") == (tmp_path / "ds" / "tokens.bin").stat().st_size
    opened = TokenData.open(f"{gcs_bucket}/ds")
    assert {k: v for k, v in opened.header.items() if k not in ("sources", "sources_digest")} == \
           {k: v for k, v in local.header.items() if k not in ("sources", "sources_digest")}
    assert opened.n("val") > 0
    for split, loop in [("train", True), ("val", False)]:
        a = Loader(opened, 4, 2, seed=1, split=split, process_index=1, process_count=2)
        b = Loader(str(tmp_path / "ds"), 4, 2, seed=1, split=split, process_index=1, process_count=2)
        for x, y, _ in zip(a, b, range(5)): npt.assert_array_equal(x, y)
    with pytest.raises(FileNotFoundError, match="no header.json"):
        TokenData.open(f"{gcs_bucket}/src")


def test_symlinked_folders_are_followed_and_loops_are_not(tmp_path):
    "A dataset assembled from symlinked folders reads through them; a link back up the tree is not walked twice."
    (tmp_path / "corpus" / "books").mkdir(parents=True)
    (tmp_path / "corpus" / "books" / "b.txt").write_text("0123456789abcdefghij")
    src = tmp_path / "src"; src.mkdir()
    (src / "a.txt").write_text("klmnopqrst")
    (src / "books").symlink_to(tmp_path / "corpus" / "books", target_is_directory=True)
    (src / "loop").symlink_to(src, target_is_directory=True)
    data = prepare_data(src, tmp_path / "out", ByteTokenizer(), seq=4, progress=False)
    assert data.header["n_documents"] == 2 and data.n() == 6 


def test_a_named_pipe_is_skipped_in_a_folder_and_refused_by_name(tmp_path):
    "Reading a pipe would block forever: inside a folder it is skipped with a warning; named directly, refused."
    import os, subprocess, sys
    src = tmp_path / "src"; src.mkdir()
    (src / "a.txt").write_text("0123456789")
    os.mkfifo(src / "pipe.txt")
    code = ("import warnings, sys; from meshtx.data import prepare_data; from meshtx.tokenizer import ByteTokenizer\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); d = prepare_data(sys.argv[1], sys.argv[2], ByteTokenizer(), seq=4, progress=False)\n"
            "print(d.n(), [str(x.message) for x in w if 'pipe' in str(x.message)])")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2 [") and "pipe.txt: not a regular file" in r.stdout
    with pytest.raises(ValueError, match="pipe.txt: not a regular file"):
        prepare_data(src / "pipe.txt", tmp_path / "out2", ByteTokenizer(), seq=4, progress=False)


def test_empty_texts_and_surrogate_escapes_are_counted_apart(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "0123456789"}\n{"text": ""}\n{"text": "  "}\n'
                                       b'{"text": "ab\\ud800cd"}\n{"text": "x\xffy"}\n')
    with pytest.warns(UserWarning) as w:
        prepare_data(tmp_path / "d.jsonl", tmp_path / "out", ByteTokenizer(), seq=4, progress=False)
    said = " | ".join(str(x.message) for x in w)
    assert "2 empty documents (nothing but whitespace), skipped" in said
    assert "1 JSON escapes of lone surrogates" in said
    assert "1 bytes that are not UTF-8 were replaced" in said


# ---- a full disk while preparing ---------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    "A 1 MB tmpfs (root only; skipped where it cannot be mounted), unmounted afterwards."
    import subprocess
    disk = tmp_path / "disk"; disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to make a small disk")
    try: yield disk
    finally:
        import gc; gc.collect()   # the datasets' memory maps hold their files open
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(disk)], check=True)   # still busy: detached now, freed when closed


def _assert_full_disk_error(e, out, name):
    import errno
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC, msg
    assert f"could not write {out.parent}" in msg and f"/{name} (staging the dataset for {out})" in msg, msg
    assert "No space left on device" in msg and f"nothing in {out} was changed" in msg and len(msg) < 500, msg


def test_a_full_disk_names_the_file_and_keeps_the_earlier_dataset(small_disk, tmp_path):
    "The disk fills while the tokens are staged: an OSError names the file and what was written; the old data stays."
    (tmp_path / "small.txt").write_text("the earlier dataset " * 500)      # 10 kB of tokens
    (tmp_path / "big.txt").write_text("much more text " * 100_000)         # 3 MB of uint16 tokens: no room
    out = small_disk / "data"
    before = prepare_data(tmp_path / "small.txt", out, ByteTokenizer(), seq=16, progress=False)
    with pytest.raises(OSError) as e:
        prepare_data(tmp_path / "big.txt", out, ByteTokenizer(), seq=16, progress=False)
    _assert_full_disk_error(e, out, "tokens.bin")
    assert " MB; nothing in" in str(e.value)                               # how far it got
    assert sorted(p.name for p in small_disk.iterdir()) == ["data"]        # the staging folder went with the error
    after = TokenData.open(out)                                            # the earlier dataset, whole
    assert after.header == before.header and after.n("train") == before.n("train")
    npt.assert_array_equal(after.windows([0, after.n() - 1]), before.windows([0, before.n() - 1]))
    del before, after


def test_a_full_disk_while_writing_the_header(tmp_path, monkeypatch):
    "The same where the header cannot be written (simulated: any disk): named, earlier dataset loadable, no staging left."
    import errno, pathlib
    (tmp_path / "a.txt").write_text("first version " * 50); (tmp_path / "b.txt").write_text("second version " * 50)
    out = tmp_path / "data"
    before = prepare_data(tmp_path / "a.txt", out, ByteTokenizer(), seq=16, progress=False)
    real = pathlib.Path.write_text
    def full(self, *a, **k):
        if self.name == "header.json": raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **k)
    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(OSError) as e:
        prepare_data(tmp_path / "b.txt", out, ByteTokenizer(), seq=16, progress=False)
    monkeypatch.undo()
    _assert_full_disk_error(e, out, "header.json")
    assert not list(tmp_path.glob(".meshtx-data-*"))
    assert TokenData.open(out).header == before.header


def prefixing_tokenizer(text: str):
    "A Llama-2/Mistral-style tokenizer (every text starts with '▁', spaces are '▁', no pre-tokenizer), trained on `text`."
    import transformers
    from tokenizers import Tokenizer, models, normalizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["prefixing", "gpt2"])
def test_a_long_document_has_the_tokens_of_the_whole_for_any_tokenizer(kind, tmp_path, monkeypatch):
    """A document longer than a part is tokenized in parts where the cut keeps the tokens (GPT-2's), and whole for a
    tokenizer that starts every text with '▁' (each part had one more token at each cut)."""
    import meshtx.data
    monkeypatch.setattr(meshtx.data, "PART_CHARS", 500)
    rng = np.random.RandomState(0)
    words = [w for w in Path(__file__).read_text().split() if w.isalnum()]   # (no separator, no special token)
    doc = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(400))   # ~40 K characters: many parts of 500
    tok = prefixing_tokenizer(doc) if kind == "prefixing" else gpt2_tokenizer()
    (tmp_path / "book.txt").write_text(doc)
    data = prepare_data(tmp_path / "book.txt", tmp_path / "out", tok, seq=63, progress=False)
    whole = tok(doc, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tok.eos_token_id]   # "<s>" as text
    got = data.windows(range(data.n())).reshape(-1)
    npt.assert_array_equal(got, whole[:len(got)])


def test_prepare_data_refuses_a_negative_seed_and_names_a_missing_end_token_before_tokenizing(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    with pytest.raises(ValueError, match="seed=-1: must be an integer"):
        prepare_data(tmp_path / "a.txt", tmp_path / "out", "bytes", seq=8, val_fraction=0.2, seed=-1, progress=False)
    tok = prefixing_tokenizer("some text")
    tok.eos_token = None
    with pytest.raises(ValueError, match="has no end-of-text token .* give eot_id"):
        prepare_data(tmp_path / "a.txt", tmp_path / "out", tok, seq=8, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_file_named_twice_is_read_once(tmp_path):
    "A folder and a glob inside it name the same files: each is read once (twice, it could be trained on and held out)."
    (tmp_path / "d").mkdir()
    for i in range(3): (tmp_path / "d" / f"{i}.txt").write_text(f"document {i} " * 40)
    with pytest.warns(UserWarning, match="3 of the files .* named more than once: each is read once"):
        data = prepare_data([tmp_path / "d", str(tmp_path / "d" / "*.txt")], tmp_path / "out", "bytes", seq=15, progress=False)
    assert data.header["n_documents"] == 3
