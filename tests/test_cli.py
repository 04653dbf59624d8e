"""The `meshtx` console script, run as a user runs it: a real process."""
import os, subprocess, sys, shutil
from pathlib import Path
import numpy as np
from meshtx import LM

def meshtx(*args, timeout=300):
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_parser_has_every_command_with_its_function():
    "parser(): the subcommands in `meshtx --help`'s order, each naming the `cmd_*` that runs it, its options as typed."
    import argparse
    from meshtx import cli
    p = cli.parser()
    assert p.format_usage() == "usage: meshtx [-h] [--version] COMMAND ...\n"
    commands = ["info", "eval", "demo", "sample", "convert", "prepare-data", "train", "finetune", "plan", "serve"]
    listed = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert list(listed) == commands
    need = {"convert": ["a", "b"], "prepare-data": ["f", "--out", "d"], "train": ["--config", "c"],
            "finetune": ["--model", "m", "--data", "d"]}
    for c in commands:
        assert p.parse_args([c, *need.get(c, [])]).func is getattr(cli, "cmd_" + c.replace("-", "_")), c
    a = p.parse_args(["sample", "--preset", "demo", "--top-p", "0.5", "--stop", r"\n"])
    assert (a.top_p, a.temperature, a.stop, a.max_new_tokens) == (0.5, 0.8, [r"\n"], 128)
    assert cli.escape_stop("\n") == r"\n" and cli.unescape_stop(r"\n") == "\n"   # still importable from meshtx.cli


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


def test_sample_stop_newline_seeds_and_long_prompts(tmp_path):
    "--stop '\\n' (as a shell passes it) stops at a newline; each run draws a seed it prints; a cut prompt is reported."
    import jax.numpy as jnp
    lm = LM.init("demo")
    b = np.array(lm.params["gptj/lm_head"]["b"]); b[198] += 9.0   # GPT-2's "\n": frequent, but not at every step
    lm.params["gptj/lm_head"]["b"] = jnp.asarray(b)
    lm.save(tmp_path / "nl")
    common = ["sample", "--model", tmp_path / "nl", "--prompt", "Hello", "--temperature", "1", "--max-new-tokens", "20", "-q"]
    full = meshtx(*common, "--seed", "3")
    assert full.returncode == 0 and "\n" in full.stdout[:-1], full   # the sample has a newline before its end
    cut = meshtx(*common, "--seed", "3", "--stop", r"\n")            # the two characters \ and n
    assert cut.returncode == 0 and cut.stdout == full.stdout.split("\n")[0] + "\n", (cut.stdout, full.stdout)
    runs = [meshtx(*common[:-1]) for _ in range(2)]                   # no --seed, no -q: a fresh seed each, on stderr
    seeds = [[l for l in r.stderr.splitlines() if l.startswith("seed: ")] for r in runs]
    assert all(len(s) == 1 for s in seeds) and seeds[0] != seeds[1], seeds
    again = meshtx(*common[:-1], "--seed", seeds[0][0].split()[1])
    assert again.stdout == runs[0].stdout and "seed: " not in again.stderr
    long = meshtx("sample", "--model", tmp_path / "nl", "--prompt", "Hello " * 600, "--max-new-tokens", "8", "-q")
    assert long.returncode == 0 and "tokens were dropped" in long.stderr, long.stderr


def test_convert_original_checkpoint_keeps_its_dtype(tmp_path):
    "`convert --mtj-config`: a slim (bf16) original checkpoint stays bf16, a full one float32, unless --dtype says."
    import json, jax
    from safetensors import safe_open
    from meshtx import init_params
    from test_checkpoint import CFG, original_shards, write_original
    run = {"layers": CFG.n_layer, "d_model": CFG.d_model, "n_heads": CFG.n_head, "n_vocab": CFG.n_vocab,
           "seq": CFG.n_ctx, "pe_rotary_dims": CFG.rotary_dim}
    (tmp_path / "run.json").write_text(json.dumps(run))
    rng = np.random.default_rng(0)
    params = jax.tree.map(np.asarray, init_params(CFG, seed=1))
    for full, stored, asked, want in [(False, "bfloat16", None, "bfloat16"), (True, np.float32, None, "float32"),
                                      (False, "bfloat16", "float32", "float32")]:
        shards, _ = original_shards(params, 2, rng, jax.numpy.bfloat16 if stored == "bfloat16" else stored)
        src, dst = tmp_path / f"step_{full}_{asked}", tmp_path / f"hf_{full}_{asked}"
        list(write_original(src, shards, full, rng))
        r = meshtx("convert", src, dst, "--mtj-config", tmp_path / "run.json", "-q", *(["--dtype", asked] if asked else []))
        assert r.returncode == 0, r.stderr
        config = json.loads((dst / "config.json").read_text())
        assert (config.get("dtype") or config.get("torch_dtype")) == want, config
        with safe_open(dst / "model.safetensors", "np" if want == "float32" else "pt") as f:
            assert str(f.get_tensor("lm_head.weight").dtype).endswith(want), (full, asked)


def test_run_config_typos_are_one_line_errors(tmp_path):
    import json
    base = {"layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 257, "seq": 32, "tokenizer": "bytes",
            "total_steps": 3, "model_dir": "run", "train_set": "docs.txt"}
    for extra, says in [({"lora": "8"}, "lora='8'"), ({"warmup_steps": "10"}, "warmup_steps='10'"),
                        ({"val_set": 5}, "val_set=5"), ({"ckpt_every": "2"}, "ckpt_every='2'")]:
        (tmp_path / "run.json").write_text(json.dumps({**base, **extra}))
        r = meshtx("train", "--config", tmp_path / "run.json", "-q")
        assert r.returncode == 2 and r.stderr.startswith("meshtx: error:") and says in r.stderr, (extra, r.stderr[-2000:])
        assert "Traceback" not in r.stderr


def test_train_an_original_config_into_its_bucket(gcs_bucket, tmp_path):
    "The original's keys mean what they meant: bucket + model_dir, sets under data/, several val sets, "
    "eval_harness_tasks (warned about); and the model the run leaves is what `meshtx sample` reads."
    import json, uuid
    import pydoc_data.topics as topics
    from meshtx.data import filesystem
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.txt").write_text("\n\n".join(topics.topics[k] for k in sorted(topics.topics)[:20]))
    (tmp_path / "data" / "other.txt").write_text("Quite another text, said again and again. " * 200)
    (tmp_path / "data" / "example.train.index").write_text("data/docs.txt\n")
    run_dir = f"t-{uuid.uuid4().hex[:8]}/run"
    (tmp_path / "run.json").write_text(json.dumps({
        "layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 257, "pe_rotary_dims": 8, "seq": 32, "tokenizer": "bytes",
        "per_replica_batch": 1, "total_steps": 2, "val_every": 2, "val_batches": 2, "tpu_size": 8,
        "bucket": gcs_bucket.removeprefix("gs://"), "model_dir": run_dir, "train_set": "example.train.index",
        "val_set": {"pile": "example.train.index", "other": "other.txt"}, "eval_harness_tasks": ["lambada"]}))
    r = subprocess.run([shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx"), "train", "--config", "run.json", "-q"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    last = [json.loads(l) for l in r.stdout.splitlines() if l.startswith('{"step"')][-1]
    assert {"val_loss_pile", "val_loss_other"} <= set(last) and "val_loss" not in last, last
    assert "eval_harness_tasks=['lambada'] are not run" in r.stderr and "meshtx eval" in r.stderr
    url = f"{gcs_bucket}/{run_dir}"
    assert json.loads(r.stdout.splitlines()[-1]) == {"model": f"{url}/model"}
    fs, root = filesystem(url)
    fs.invalidate_cache()
    assert {"model", "data", "step_00000002"} <= {p.rsplit("/", 1)[-1] for p in fs.ls(root)}
    assert not (tmp_path / run_dir).exists()                        # nothing went to a local folder of that name
    s = meshtx("sample", "--model", f"{url}/model", "--prompt", "def", "--max-new-tokens", "4", "--seed", "0", "-q")
    assert s.returncode == 0, s.stderr[-2000:]


def test_cli_newcomer_fixes(tmp_path):
    "What got in a new user's way: a missing model named as missing, options refused before any loading, eval's help."
    r = meshtx("sample", "--model", tmp_path / "missing", "--prompt", "x")
    assert r.returncode == 2 and "is not a checkpoint directory: it does not exist" in r.stderr, r.stderr
    r = meshtx("sample", "--model", tmp_path / "missing", "--top-p", "1.5")   # refused by the parser: nothing loads
    assert r.returncode == 2 and "--top-p: invalid top_p=1.5: must be between 0 and 1" in r.stderr, r.stderr
    for bad in (("--temperature", "-1"), ("--temperature", "nan"), ("--top-k", "-2"), ("--repetition-penalty", "0")):
        r = meshtx("sample", "--preset", "demo", *bad)
        assert r.returncode == 2 and f"argument {bad[0]}" in r.stderr, (bad, r.stderr)
    for bad in (("--lr", "nan"), ("--lr", "0"), ("--lora-alpha", "-1"), ("--val-fraction", "1")):   # before any tokenizing
        r = meshtx("finetune", "--model", tmp_path / "missing", "--data", tmp_path / "missing.txt", *bad)
        assert r.returncode == 2 and f"argument {bad[0]}: invalid" in r.stderr, (bad, r.stderr)
    r = meshtx("prepare-data", tmp_path / "missing.txt", "--out", tmp_path / "d", "--val-fraction", "-0.1")
    assert r.returncode == 2 and "argument --val-fraction: invalid val_fraction=-0.1" in r.stderr, r.stderr
    r = meshtx("serve", tmp_path / "missing", "--port", "0")            # the model as a positional argument
    assert r.returncode == 2 and "is not a checkpoint directory: it does not exist" in r.stderr, r.stderr
    r = meshtx("serve", tmp_path / "a", "--preset", "tiny")
    assert r.returncode == 2 and "give the model once" in r.stderr
    r = meshtx("serve")
    assert r.returncode == 2 and "give a model" in r.stderr
    r = meshtx("eval", "--help")
    assert r.returncode == 0 and "meshtx eval --model_args pretrained=" in r.stdout and "--model hf" not in r.stdout
    r = meshtx("eval", "--model", "hf", "--tasks", "x")
    assert r.returncode == 2 and "runs lm_eval's `meshtx` model" in r.stderr
    r = meshtx("train", "--help")
    assert r.returncode == 0 and "example config" in r.stdout and '"train_set"' in r.stdout


def test_careless_inputs_get_one_line_errors(tmp_path):
    "What a careless user types: each refused in one line that names it, before anything is written or trained."
    (tmp_path / "c.txt").write_text("hello world\n")
    r = meshtx("demo", "--seconds", "0")
    assert r.returncode == 2 and "--seconds: invalid seconds=0.0: must be > 0" in r.stderr, r.stderr
    r = meshtx("sample", "--model", tmp_path / "x", "--preset", "demo", "--prompt", "hi")
    assert r.returncode == 2 and "give --model or --preset, not both" in r.stderr, r.stderr
    r = meshtx("prepare-data", tmp_path / "c.txt", "--out", "")   # an unset $OUT: not the current folder
    assert r.returncode == 2 and "out is empty" in r.stderr and not Path("header.json").exists(), r.stderr
    r = meshtx("prepare-data", tmp_path / "c.txt", "--out", tmp_path)
    assert r.returncode == 2 and "inside the output folder" in r.stderr, r.stderr
    r = meshtx("prepare-data", tmp_path / "c.txt", "--out", tmp_path / "o", "--tokenizer", tmp_path / "no-such-tok")
    assert r.returncode == 2 and "no-such-tok: no such directory" in r.stderr, r.stderr
    r = meshtx("sample", "--preset", "demo", "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape"), "--max-new-tokens", "2")
    assert r.returncode == 2 and "lone surrogate" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for argv in (("convert", tmp_path / "m", tmp_path / "hf", "--max-shard-size", "70000"),   # plain bytes, as HF takes
                 ("convert", tmp_path / "m", tmp_path / "hf2", "--max-shard-size", "1MiB")):
        if not (tmp_path / "m").exists(): LM.init("tiny").save(tmp_path / "m")
        r = meshtx(*argv, "--to", "hf")
        assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1 and len(list((tmp_path / "hf2").glob("*.safetensors"))) == 1
    (tmp_path / "m" / "meshtx_config.json").write_text('{"d_model": 64}')
    r = meshtx("convert", tmp_path / "m", tmp_path / "hf3", "--to", "hf")
    assert r.returncode == 2 and "missing ModelConfig field(s) ['n_layer', 'n_head', 'n_vocab']" in r.stderr, r.stderr


def test_out_of_memory_is_one_line_that_says_what_to_do(monkeypatch, capsys):
    import jax
    from meshtx import cli
    def boom(args): raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 67266406200 bytes.")
    monkeypatch.setattr(cli, "cmd_plan", boom)
    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda self, argv=None: cli.argparse.Namespace(func=boom))
    assert cli.main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtx: error: out of memory (RESOURCE_EXHAUSTED") and "meshtx plan" in err and "Traceback" not in err


def test_convert_keeps_the_dtype_the_tensors_have_when_config_json_names_none(tmp_path):
    "A float16 checkpoint whose config.json names no dtype converts back as float16 (its tensors say so), bit for bit."
    import json
    from safetensors.numpy import load_file
    LM.init("tiny").save_hf(tmp_path / "hf", dtype="float16", progress=False)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}))
    for src, dst in (("hf", "mtx"), ("mtx", "back")):
        r = meshtx("convert", tmp_path / src, tmp_path / dst, "-q")
        assert r.returncode == 0, r.stderr
    a, b = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("hf", "back"))
    assert a.keys() == b.keys() and all(b[k].dtype == np.float16 and np.array_equal(a[k], b[k]) for k in a)


def test_a_first_hours_slips_are_said_before_anything_runs(tmp_path, monkeypatch, capsys):
    "A cache folder that cannot be made only warns; a bad seed, LoRA options without --lora and a demo folder that "
    "holds someone's files are refused before a model loads or trains; a demo whose loss did not fall says so."
    (tmp_path / "afile").write_text("")
    r = subprocess.run([shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx"), "plan", "--preset", "tiny"],
                       capture_output=True, text=True, timeout=300, env=os.environ | {"MESHTX_CACHE_DIR": str(tmp_path / "afile")})
    assert r.returncode == 0 and "meshtx: warning: no compilation cache" in r.stderr and "Traceback" not in r.stderr, r.stderr
    from meshtx.cli import main
    monkeypatch.setenv("MESHTX_CACHE_DIR", "off")
    for argv, said in ((["sample", "--preset", "tiny", "--prompt", "hi", "--seed", "-1"], "invalid seed=-1"),
                       (["demo", "--seed", "4294967296"], "invalid seed=4294967296"),
                       (["finetune", "--model", "m", "--data", "d", "--lora-alpha", "4"], "add --lora RANK")):
        try: code = main(argv)
        except SystemExit as e: code = e.code
        assert code == 2 and said in capsys.readouterr().err, argv
    (tmp_path / "d" / "checkpoint").mkdir(parents=True); (tmp_path / "d" / "checkpoint" / "notes.txt").write_text("mine")
    assert main(["demo", "--out", str(tmp_path / "d"), "--steps", "5", "-q"]) == 2
    err = capsys.readouterr()
    assert "holds other files (notes.txt)" in err.err and "samples" not in err.out    # refused before it trained
    assert main(["demo", "--out", str(tmp_path / "e"), "--steps", "1", "-q"]) == 1
    assert "the held-out loss did not fall" in capsys.readouterr().err
