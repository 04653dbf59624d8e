"""Training end to end: the original recipe, exact resume after kill -9, gs:// runs, fine-tuning a HF model."""
import itertools, json, math, os, shutil, signal, subprocess, sys
from pathlib import Path
import numpy as np
import numpy.testing as npt
import jax, jax.numpy as jnp
import pytest
from meshtx import LM
from meshtx.config import ModelConfig
from meshtx.model import init_params
from meshtx.train import lr_schedule, make_optimizer, make_train_step, TrainState, Trainer

CFG = ModelConfig(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=257, n_ctx=64)


def original_schedule(step, lr, end_lr, warmup, anneal):
    "mesh-transformer-jax's gpt3_schedule, written out independently."
    warmup_pct = min(1.0, step / warmup) if warmup else 1.0
    t = min(max(step - warmup, 0), anneal) / anneal
    return warmup_pct * lr - (lr - end_lr) * (1 - math.cos(math.pi * t)) / 2


def test_schedule_equals_the_original_formula():
    s = lr_schedule(6e-4, 6e-5, 300, 10_000)
    for step in (0, 1, 150, 299, 300, 301, 2500, 5300, 10_299, 10_300, 10_301, 50_000):
        assert abs(float(s(step)) - original_schedule(step, 6e-4, 6e-5, 300, 10_000)) < 1e-9, step


def test_weight_decay_spares_biases_and_layernorms():
    params = init_params(CFG)
    opt = make_optimizer(lr=1e-2, weight_decay=0.3)
    zeros = jax.tree.map(jnp.zeros_like, params)
    upd, _ = opt.update(zeros, opt.init(params), params)
    for module, ps in upd.items():
        for name, u in ps.items():
            decayed = bool(jnp.any(u != 0))
            is_matrix = name in ("w", "q", "k", "v", "out", "embedding")
            assert decayed == is_matrix, (module, name)


@pytest.mark.compat
def test_accumulation_equals_one_big_batch():
    params = init_params(CFG)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.n_vocab, (8, 17)))
    opt = make_optimizer(lr=1e-4)
    step = make_train_step(CFG, opt)
    fresh = lambda: TrainState(jax.tree.map(jnp.copy, params), opt.init(params), jnp.zeros((), jnp.int32))
    a, ma = step(fresh(), tokens.reshape(1, 8, 17))
    b, mb = step(fresh(), tokens.reshape(4, 2, 17))
    assert abs(float(ma["loss"]) - float(mb["loss"])) <= 1e-5
    jax.tree.map(lambda x, y: npt.assert_allclose(x, y, atol=1e-5), a.params, b.params)


def test_non_finite_losses_skip_then_stop():
    lm = LM.init(CFG)
    lm.params["gptj/lm_head"]["b"] = lm.params["gptj/lm_head"]["b"].at[3].set(jnp.nan)
    batch = np.random.default_rng(0).integers(0, CFG.n_vocab, (1, 2, 9))
    t = Trainer(lm, itertools.repeat(batch), nan_patience=3, progress=False)
    with pytest.warns(UserWarning, match="update skipped"):
        t.step(); t.step()
    with pytest.raises(FloatingPointError, match="3 steps in a row"), pytest.warns(UserWarning):
        t.step()


def _run_config(tmp_path, model_dir, data):
    run = dict(layers=2, d_model=64, n_heads=4, n_vocab=257, seq=32, pe_rotary_dims=8, tokenizer="bytes",
               per_replica_batch=4, gradient_accumulation_steps=2, lr=3e-3, end_lr=3e-4, warmup_steps=3,
               anneal_steps=15, total_steps=20, ckpt_every=10, keep_every=10, model_dir=str(model_dir),
               train_set=str(data), seed=1)
    path = tmp_path / f"{Path(model_dir).name}.json"
    path.write_text(json.dumps(run))
    return path


def _meshtx_train(config, kill_after=None):
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen([exe, "train", "--config", str(config), "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines = []
    for line in proc.stdout:
        if "model" in json.loads(line): continue   # the last line names the model written: not a step
        lines.append(json.loads(line))
        if kill_after is not None and lines[-1].get("step") == kill_after:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=120)
    err = proc.stderr.read()
    if kill_after is None: assert proc.returncode == 0, err
    else: assert proc.returncode == -signal.SIGKILL
    return lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import pydoc_data.topics as topics
    d = tmp_path_factory.mktemp("corpus")
    (d / "docs.txt").write_text("\n".join(topics.topics[k] for k in sorted(topics.topics)[:40]))
    return d / "docs.txt"


@pytest.mark.compat
def test_resume_after_kill_9_is_exact(tmp_path, corpus):
    from meshtx.checkpoint import Checkpointer
    straight = _meshtx_train(_run_config(tmp_path, tmp_path / "straight", corpus))
    assert [r["step"] for r in straight] == list(range(1, 21))
    cfg = _run_config(tmp_path, tmp_path / "killed", corpus)
    first = _meshtx_train(cfg, kill_after=15)
    assert [r["step"] for r in first] == list(range(1, 16))
    assert Checkpointer(tmp_path / "killed").steps() == [10]
    second = _meshtx_train(cfg)
    assert second[0] == {"resumed_from": 10}
    resumed = first[:10] + second[1:]
    assert [r["step"] for r in resumed] == list(range(1, 21))
    npt.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in straight], rtol=0, atol=1e-6)
    npt.assert_allclose([r["loss"] for r in first], [r["loss"] for r in straight[:15]], rtol=0, atol=1e-6)
    assert Checkpointer(tmp_path / "killed").steps() == [10, 20]


def test_training_run_on_gcs(gcs_bucket, tmp_path, corpus):
    import fsspec
    from meshtx.runs import train
    from meshtx.checkpoint import Checkpointer
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    fs.put(str(corpus), f"{gcs_bucket}/corpus/docs.txt")
    run = json.loads(_run_config(tmp_path, "run", corpus).read_text())
    run.update(model_dir=f"{gcs_bucket}/runs/a", train_set=f"{gcs_bucket}/corpus/docs.txt", total_steps=6, ckpt_every=3,
               keep=1, keep_every=None)
    lines = []
    train(run, log=lines.append)
    assert Checkpointer(f"{gcs_bucket}/runs/a").steps() == [6]
    assert fs.exists(f"{gcs_bucket}/runs/a/data/train/header.json")
    run["total_steps"] = 8
    more = []
    t = train(run, log=more.append)
    records = [json.loads(l) for l in more]
    assert records[0] == {"resumed_from": 6} and [r["step"] for r in records if "step" in r] == [7, 8]
    assert records[-1] == {"model": f"{gcs_bucket}/runs/a/model"}          # the model of step 8 replaced step 6's
    assert len(t.history) == 8 and fs.exists(f"{gcs_bucket}/runs/a/model/config.json")


def _hf_perplexity(model_dir, text_ids):
    import torch, transformers
    model = transformers.GPTJForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(text_ids)[None])
    with torch.no_grad(): return math.exp(float(model(ids, labels=ids).loss))


@pytest.mark.parametrize("lora", [False, True])
def test_finetune_lowers_perplexity_of_a_hf_model(hf_checkpoint, tmp_path, lora):
    from meshtx.cli import main
    from meshtx.tokenizer import gpt2_tokenizer
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, rotary_dim=8, n_vocab=50257, n_ctx=128)
    path, _ = hf_checkpoint(cfg)
    tok = gpt2_tokenizer()
    tok.save_pretrained(path)
    text = ("Mesh Transformer JAX trained GPT-J on TPUs. meshtx fine-tunes it anywhere, from a notebook. " * 30)
    (tmp_path / "text.txt").write_text(text)
    args = ["finetune", "--model", path, "--data", tmp_path / "text.txt", "--out", tmp_path / "out", "--steps", "25",
            "--batch", "4", "--seq", "32", "--lr", "3e-3", "--val-fraction", "0.2", "-q"] + (["--lora", "8"] if lora else [])
    assert main(args) == 0
    ids = tok(text[:600])["input_ids"][:120]
    before, after = _hf_perplexity(path, ids), _hf_perplexity(tmp_path / "out" / "model", ids)
    assert after < before / 2, (before, after)
    assert (tmp_path / "out" / "adapters" / "lora.json").exists() == lora


@pytest.mark.parametrize("lora", [False, True])
def test_steps_compile_once(lora):
    """The first state sits on the device as committed as the step's outputs: the second step must not compile the step
    again (at GPT-J-6B's width that second compile held ~0.3 GB per 8 layers more, and cost as long as the first)."""
    from meshtx import LoRAConfig
    batch = np.random.default_rng(0).integers(0, CFG.n_vocab, (1, 2, 17))
    t = Trainer(LM.init(CFG), itertools.repeat(batch), lora=LoRAConfig(rank=4) if lora else None, progress=False)
    t.evaluate([batch])
    t.run(3)
    t.evaluate([batch])
    assert t._step._cache_size() == 1 and t._eval._cache_size() == 1


def test_bad_settings_and_batches_are_refused_by_name():
    """What a notebook user can hand a Trainer that would train backwards, train nothing, or fail as a NaN or an
    index error deep inside a step: refused now, naming it."""
    batch = np.tile(np.arange(10, 42), 3)[None, None, :33].repeat(4, axis=1)
    for kw, msg in [(dict(clip=-1.0), "clip=-1.0 must be"), (dict(weight_decay=float("nan")), "weight_decay=nan must be"),
                    (dict(warmup_steps=-5), "warmup_steps=-5 must be an integer ≥ 0")]:
        with pytest.raises(ValueError, match=msg): Trainer(LM.init(CFG), itertools.repeat(batch), progress=False, **kw)
    t = Trainer(LM.init(CFG), itertools.repeat(batch), clip=0, lr=1e-2, progress=False)   # 0: no clipping, as HF's
    first = t.evaluate([batch]); t.run(4)
    assert t.evaluate([batch]) < first - 0.5
    for bad, msg in [(-batch, "token ids from -41 to -10, outside \\[0, 257\\)"), (batch.astype(bool), "not bool"),
                     (batch[..., :1], "seq ≥ 1"), (np.zeros((1, 1, 71), int), "70 \\+ 1 tokens exceed the model's n_ctx=64"),
                     (batch.astype(float), "integer token ids, not float64")]:
        t.train_data = iter([bad])
        with pytest.raises(ValueError, match=msg): t.step()
    t.lm.add_lora(4)   # a full fine-tune's trainer, after adapters were added: it would write weights without them
    with pytest.raises(ValueError, match="LoRA adapters were added since"): t.step()
    lm = LM.init(CFG)
    one, two = (Trainer(lm, itertools.repeat(batch), progress=False) for _ in range(2))
    two.step()   # consumed the weights both were given
    with pytest.raises(ValueError, match="handed to another trainer's step"): one.step()


def test_adafactor_trains():
    batch = np.tile(np.arange(10, 42), 3)[None, None, :33].repeat(4, axis=1)
    t = Trainer(LM.init(CFG), itertools.repeat(batch), optimizer="adafactor", lr=1e-2, progress=False)
    first = t.evaluate([batch])
    t.run(15)
    assert t.evaluate([batch]) < first - 1.0


def test_adafactor_on_a_mesh_equals_one_device():
    "Adafactor's row and column statistics (shapes no parameter has) get layouts of their own on a mesh."
    from meshtx.sharding import make_mesh
    cfg = ModelConfig(n_layer=2, d_model=128, n_head=4, rotary_dim=8, d_ff=256, n_vocab=256, n_ctx=32)   # dims ≥ 128: factored
    batches = np.random.default_rng(0).integers(0, 256, (2, 1, 8, 17)).astype(np.int32)
    def train(mesh):
        t = Trainer(LM.init(cfg, tokenizer=None, mesh=mesh), iter(batches), optimizer="adafactor", lr=1e-4, progress=False)
        losses = [t.step()["loss"] for _ in batches]
        return losses, jax.tree.map(np.asarray, t.params), t.state.opt_state
    ref_losses, ref_params, _ = train(None)
    losses, params, opt_state = train(make_mesh(fsdp=4, mp=2, config=cfg))
    v_row = opt_state[1][0].v_row["gptj/blocks/mlp/fc_in"]["w"]   # [L, D, F] without F: split over fsdp like D
    assert v_row.shape == (2, 128) and v_row.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp"), v_row.sharding
    npt.assert_allclose(losses, ref_losses, atol=1e-5)
    jax.tree.map(lambda a, b: npt.assert_allclose(a, b, atol=1e-5), params, ref_params)


def test_trainer_save_restore_and_weights_only(tmp_path):
    from meshtx.data import prepare_data, Loader
    from meshtx.tokenizer import ByteTokenizer
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 100)
    data = prepare_data(tmp_path / "t.txt", tmp_path / "data", ByteTokenizer(), seq=16, progress=False)
    def trainer(): return Trainer(LM.init(CFG, seed=2), Loader(data, 4, seed=5), lr=1e-3, checkpoint_dir=tmp_path / "ck", progress=False)
    a = trainer()
    for _ in range(3): a.step()
    a.save()
    rest = [a.step()["loss"] for _ in range(2)]
    b = trainer()
    assert b.restore() == 3 and len(b.history) == 3 and b.loader.position == 3
    assert [b.step()["loss"] for _ in range(2)] == rest                     # same state, same next batches
    c = trainer()
    c.restore(weights_only=True)                                            # the original's --fresh-opt
    assert int(c.state.step) == 0 and c.history == [] and c.loader.position == 0
    saved, _ = a._checkpointer().restore(3)
    jax.tree.map(npt.assert_array_equal, jax.tree.map(np.asarray, c.state.params), saved["params"])
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(c.state.opt_state[1][0].mu))



def test_resume_prunes_what_a_kill_during_pruning_left(tmp_path, monkeypatch):
    "A run killed while pruning after its last save holds one checkpoint too many; resuming prunes it (keep=2)."
    import meshtx.checkpoint as C
    batch = np.random.default_rng(0).integers(0, 257, (1, 2, 17)).astype(np.int32)
    def trainer(): return Trainer(LM.init(CFG, seed=2), itertools.repeat(batch), lr=1e-3, checkpoint_dir=tmp_path / "ck",
                                  keep=2, progress=False)
    a = trainer()
    for _ in range(3): a.step(); a.save()
    assert a._checkpointer().steps() == [2, 3]
    monkeypatch.setattr(C.Checkpointer, "_apply_keep", lambda self: None)   # the kill: the last save never prunes
    a.step(); a.save()
    monkeypatch.undo()
    assert a._checkpointer().steps() == [2, 3, 4]
    b = trainer()
    assert b.restore() == 4 and b._checkpointer().steps() == [3, 4]
    c = trainer()
    assert c.restore(step=3) == 3 and c._checkpointer().steps() == [3, 4]    # restoring an earlier step prunes nothing


def test_lm_load_reads_a_training_checkpoint(tmp_path):
    "What `meshtx train` or the fine-tune widget saved loads as a model: the folder (its latest step) or one step."
    from meshtx.tokenizer import ByteTokenizer
    batch = np.random.RandomState(0).randint(0, 100, (2, 17))
    model = LM.init(CFG, seed=2, tokenizer=ByteTokenizer())
    model.generation_config = {"eos_token_id": [7, 9], "temperature": 0.6}   # a chat model's, from its generation_config.json
    t = Trainer(model, itertools.repeat(batch), lr=1e-3, checkpoint_dir=tmp_path / "ck", progress=False)
    t.step(); t.save(); t.step(); last = t.save()
    for path in (tmp_path / "ck", last):
        lm = LM.load(path)
        assert lm.config == t.lm.config
        assert isinstance(lm.tokenizer, ByteTokenizer)   # kept beside the checkpoints: no default could guess it
        assert lm.generation_config == model.generation_config   # and so are its sampling defaults, for its next save
        jax.tree.map(npt.assert_array_equal, jax.tree.map(np.asarray, lm.params), jax.tree.map(np.asarray, t.lm.params))
    first = LM.load(tmp_path / "ck" / "step_00000001")
    assert not np.array_equal(np.asarray(first.logits([[1, 2, 3]])), np.asarray(lm.logits([[1, 2, 3]])))
    lora = Trainer(LM.init(CFG, seed=2), itertools.repeat(batch), lr=1e-3, lora=4, checkpoint_dir=tmp_path / "lo", progress=False)
    lora.step()
    with pytest.raises(ValueError, match="LoRA fine-tune's checkpoint: it holds the adapters, not the model"):
        LM.load(lora.save())


def test_an_interrupt_during_a_step_arrives_after_it_is_recorded():
    "Ctrl-C in the middle of a step: the step is taken and counted, then KeyboardInterrupt; the trainer goes on."
    batch = np.random.RandomState(0).randint(0, 100, (2, 17))
    t = Trainer(LM.init(CFG, seed=2), itertools.repeat(batch), lr=1e-3, progress=False)
    real = t._step
    def interrupted_step(*a):   # the signal arrives while the device works on the step
        os.kill(os.getpid(), signal.SIGINT); return real(*a)
    t._step = interrupted_step
    # Python's own Ctrl-C handler, as a script or a notebook kernel has it while a cell runs (another test in this
    # process, a server say, may have left its own: the trainer defers whichever it finds, and only Python's raises)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            t.step()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # Python's own handler is back
    finally: signal.signal(signal.SIGINT, before)
    t._step = real
    assert (len(t.history), int(t.state.step)) == (1, 1)
    t.step()
    assert len(t.history) == 2 and np.isfinite(np.asarray(t.lm.logits([[1, 2, 3]]))).all()

def test_prepare_data_command(tmp_path):
    from meshtx.cli import main
    from meshtx.data import TokenData
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"line {i} of the corpus"}) + "\n" for i in range(200)))
    assert main(["prepare-data", tmp_path / "a.jsonl", "--out", tmp_path / "ds", "--seq", "64", "--val-fraction", "0.1",
                 "--tokenizer", "gpt2", "-q"]) == 0
    data = TokenData.open(tmp_path / "ds")
    assert data.seq == 64 and data.n("val") >= 1 and data.header["vocab_size"] == 50257
    assert main(["prepare-data", tmp_path / "missing.txt", "--out", tmp_path / "ds2", "-q"]) == 2
    assert not (tmp_path / "ds2").exists()
