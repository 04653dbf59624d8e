"""Sharded atomic checkpoints (local and gs:// through a GCS emulator), restoring onto other meshes, crashes
(kill -9) in the middle of a save, and import of the original mesh-transformer-jax V1 checkpoints."""
import json, os, signal, socket, subprocess, sys, textwrap, time, uuid
from pathlib import Path
import numpy as np
import pytest
import jax, jax.numpy as jnp
import optax
from jax.sharding import SingleDeviceSharding
from meshtx.config import ModelConfig
from meshtx.model import init_params, param_shapes
from meshtx.sharding import make_mesh, param_shardings
from meshtx.checkpoint import Checkpointer, tree_paths, load_mtj_checkpoint

pytestmark = pytest.mark.compat   # also run under jax==0.7.2

CFG = ModelConfig.preset("tiny")


def assert_trees_equal(a, b):
    "Same structure, same leaf types, bitwise-equal values."
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (path, type(x), type(y))
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (path, x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(x.view(np.uint8) if x.ndim else x, y.view(np.uint8) if y.ndim else y, err_msg=str(path))


def abstract(config, mesh_or_sharding):
    "The params of `config` as ShapeDtypeStructs laid out on a mesh (or all on one sharding)."
    shapes = param_shapes(config)
    if isinstance(mesh_or_sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=mesh_or_sharding), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        param_shardings(config, mesh_or_sharding))


def mixed_tree():
    params = init_params(CFG)
    opt = optax.adamw(1e-3)
    return {"params": params, "opt_state": opt.init(params),
            "bf16": (jnp.arange(12, dtype=jnp.float32) / 7).astype(jnp.bfloat16).reshape(3, 4),
            "ints": {"i32": jnp.arange(5, dtype=jnp.int32), "np_i64": np.arange(6, dtype=np.int64).reshape(2, 3),
                     "u8": np.array([0, 255], np.uint8), "mask": np.array([True, False])},
            "scalars": (7, 2.5, True, np.float32(1.25), np.int32(-3), jnp.float32(0.5)),
            "key": jax.random.key(3)}


def test_round_trip_mixed_tree_bitwise(tmp_path):
    tree = mixed_tree()
    ck = Checkpointer(tmp_path / "run")
    ck.file_bytes = 8 << 10       # many files, big arrays cut into row blocks
    path = ck.save(10, tree, metadata={"loss": 1.5, "note": "hi"})
    assert path == str(tmp_path / "run" / "step_00000010")
    assert len(list(Path(path).glob("process_00000_*.safetensors"))) > 5
    back, meta = ck.restore(target=tree)
    assert meta == {"loss": 1.5, "note": "hi"} and ck.metadata(10) == meta
    assert jax.random.key_data(back.pop("key")).tolist() == jax.random.key_data(tree.pop("key")).tolist()
    assert_trees_equal(back, tree)
    # without a target: nested dicts of numpy arrays, Python scalars stay Python scalars
    plain, _ = ck.restore(10)
    assert plain["scalars"]["0"] == 7 and type(plain["scalars"]["0"]) is int and type(plain["scalars"]["2"]) is bool
    assert plain["bf16"].dtype == jnp.bfloat16 and isinstance(plain["bf16"], np.ndarray)
    np.testing.assert_array_equal(plain["params"]["gptj/blocks/attn"]["q"], np.asarray(tree["params"]["gptj/blocks/attn"]["q"]))
    np.testing.assert_array_equal(plain["opt_state"]["0"]["mu"]["gptj/wte"]["embedding"], 0)
    # the data files are ordinary safetensors files
    from safetensors import safe_open
    with safe_open(str(next(Path(path).glob("*.safetensors"))), framework="pt") as f:
        assert len(list(f.keys())) >= 1


def test_tree_paths_names():
    tree = {"params": {"gptj/wte": {"embedding": 1}}, "opt": optax.adam(1e-3).init({"w": np.zeros(1)}), "t": (2, 3)}
    assert set(tree_paths(tree)) == {"params/gptj/wte/embedding", "opt/0/count", "opt/0/mu/w", "opt/0/nu/w", "t/0", "t/1"}


def test_restore_onto_other_meshes_and_one_device(tmp_path):
    mesh = make_mesh(2, 1, 4, config=CFG)
    params = init_params(CFG, seed=5, shardings=param_shardings(CFG, mesh))
    ck = Checkpointer(tmp_path)
    path = ck.save(1, {"params": params, "step": 1})
    # each tensor is written once: replicas over dp skipped, mp shards each once
    chunks = json.loads((Path(path) / "process_00000.json").read_text())["chunks"]
    count = lambda name: sum(c["tensor"] == name for c in chunks)
    assert count("params/gptj/blocks/attn/q") == 4 and count("params/gptj/blocks/ln_1/scale") == 1
    expected = jax.tree.map(np.asarray, params)
    for target in (abstract(CFG, make_mesh(8, 1, 1, config=CFG)), abstract(CFG, make_mesh(1, 2, 4, config=CFG)),
                   abstract(CFG, SingleDeviceSharding(jax.devices()[0]))):
        back, _ = ck.restore(1, target={"params": target})
        for name, x in tree_paths(back["params"]).items():
            assert x.sharding == tree_paths(target)[name].sharding, name
        assert_trees_equal(jax.tree.map(np.asarray, back["params"]), expected)
    # arrays as the target: their shardings are used
    like = jax.device_put(jax.tree.map(jnp.zeros_like, params), param_shardings(CFG, make_mesh(4, 1, 2, config=CFG)))
    back, _ = ck.restore(1, target={"params": like})
    assert back["params"]["gptj/blocks/attn"]["q"].sharding == like["gptj/blocks/attn"]["q"].sharding
    assert_trees_equal(jax.tree.map(np.asarray, back["params"]), expected)


def test_weights_only_restore(tmp_path):
    params = init_params(CFG, seed=1)
    opt = optax.adamw(1e-2)
    ck = Checkpointer(tmp_path)
    ck.save(3, {"params": params, "opt_state": opt.init(params), "step": 3}, metadata={"step": 3})
    back, meta = ck.restore(target={"params": abstract(CFG, SingleDeviceSharding(jax.devices()[0]))})
    assert set(back) == {"params"} and meta == {"step": 3}
    assert_trees_equal(jax.tree.map(np.asarray, back["params"]), jax.tree.map(np.asarray, params))
    # None leaves come back as numpy
    back, _ = ck.restore(target={"step": None, "params": {"gptj/ln_f": {"scale": None}}})
    assert back["step"] == 3 and isinstance(back["params"]["gptj/ln_f"]["scale"], np.ndarray)


def test_keep_policy_steps_latest(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, keep_every=3)
    assert ck.steps() == [] and ck.latest() is None
    for s in range(1, 8):
        ck.save(s, {"x": np.full(4, s)})
    assert ck.steps() == [3, 6, 7] and ck.latest() == 7
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000006", "step_00000007"]
    assert ck.restore(np.int64(6))[0]["x"].tolist() == [6] * 4 and ck.metadata(jnp.int32(7)) == {}
    bare = Checkpointer(tmp_path / "bare")          # a tree that is a single array
    bare.save(jnp.int32(2), np.arange(3))
    assert bare.restore()[0].tolist() == [0, 1, 2] and bare.steps() == [2]
    every = Checkpointer(tmp_path / "all", keep=None)
    for s in (5, 1, 9):
        every.save(s, {"x": s})
    assert every.steps() == [1, 5, 9]
    with pytest.raises(ValueError, match="already exists"):
        every.save(5, {"x": 0})
    with pytest.raises(ValueError, match="keep=0"):
        Checkpointer(tmp_path, keep=0)


CRASH_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import numpy as np
    import meshtx.checkpoint as C
    url, mode, sentinel = sys.argv[1:4]

    def tree(k): return {"a": np.full((64, 64), k, np.float32), "b": np.arange(1000) * k, "c": k}
    ck = C.Checkpointer(url, keep=None)
    ck.file_bytes = 4096
    ck.save(1, tree(1))
    real_chunk, real_bytes, calls = C._write_chunk_file, C.write_atomic, []

    def slow_chunk(fs, path, pieces, fetch):      # the third data file: half written, then stuck until killed
        calls.append(path)
        if len(calls) == 3:
            with fs.open(path, "wb") as f:
                f.write(b"partial" * 100); f.flush()
                open(sentinel, "w").close()
                time.sleep(600)
        return real_chunk(fs, path, pieces, fetch)

    def die_at_marker(path, data, fs=None):       # every data file and manifest written, then killed
        if path.endswith("/" + C.MARKER):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_bytes(path, data, fs)

    if mode == "data": C._write_chunk_file = slow_chunk
    else: C.write_atomic = die_at_marker
    ck.save(2, tree(2))
    print("not killed")
''')


def crash_tree(k): return {"a": np.full((64, 64), k, np.float32), "b": np.arange(1000) * k, "c": k}


@pytest.mark.parametrize("where,mode", [("local", "data"), ("local", "marker"), ("gs", "data"), ("gs", "marker")])
def test_kill_during_save(tmp_path, request, where, mode):
    url = str(tmp_path / "run") if where == "local" else f"{request.getfixturevalue('gcs_bucket')}/crash-{uuid.uuid4().hex}"
    script, sentinel = tmp_path / "crash.py", tmp_path / "writing"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, str(script), url, mode, str(sentinel)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while mode == "data" and not sentinel.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the save never reached its third file"
            time.sleep(0.05)
        if mode == "data": proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL, proc.stdout.read()
    finally:
        if proc.poll() is None: proc.kill(); proc.wait()
    ck = Checkpointer(url, keep=None)
    before = ck._listing()
    assert any(not p.startswith("step_00000001") for p in before), before      # debris of step 2 is there
    assert ck.steps() == [1] and ck.latest() == 1
    back, _ = ck.restore(target=crash_tree(1))
    assert_trees_equal(back, crash_tree(1))
    ck.save(2, crash_tree(2))
    assert ck.steps() == [1, 2]
    assert {p.split("/")[0] for p in ck._listing()} == {"step_00000001", "step_00000002"}   # debris cleaned
    assert_trees_equal(ck.restore(2, target=crash_tree(2))[0], crash_tree(2))


def test_gcs_save_restore_keep(gcs_bucket):
    url = f"{gcs_bucket}/run-{uuid.uuid4().hex}"
    mesh = make_mesh(2, 1, 4, config=CFG)
    params = init_params(CFG, seed=2, shardings=param_shardings(CFG, mesh))
    ck = Checkpointer(url, keep=2, keep_every=2)
    ck.file_bytes = 32 << 10
    for s in (1, 2, 3, 4, 5):
        path = ck.save(s, {"params": params, "step": s}, metadata={"s": s})
    assert path == f"{url}/step_00000005"
    assert ck.steps() == [2, 4, 5] and ck.latest() == 5
    import fsspec
    fs, root = fsspec.core.url_to_fs(url, token="anon")
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["step_00000002", "step_00000004", "step_00000005"]
    back, meta = Checkpointer(url).restore(target={"params": abstract(CFG, make_mesh(8, 1, 1, config=CFG)), "step": None})
    assert meta == {"s": 5} and back["step"] == 5
    assert_trees_equal(jax.tree.map(np.asarray, back["params"]), jax.tree.map(np.asarray, params))


def test_errors_are_clear(tmp_path):
    ck = Checkpointer(tmp_path / "run")
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        ck.restore()
    params = init_params(CFG)
    ck.save(1, {"params": params})
    with pytest.raises(ValueError, match=r"no complete checkpoint for step 2 in .*complete steps: \[1\]"):
        ck.restore(2)
    target = abstract(CFG, SingleDeviceSharding(jax.devices()[0]))
    bad = {"params": {**target, "gptj/wte": {"embedding": jax.ShapeDtypeStruct((10, 64), jnp.float32)},
                      "gptj/ln_f": {"scale": jax.ShapeDtypeStruct((64,), jnp.bfloat16), "offset": None},
                      "missing": None}}
    with pytest.raises(ValueError) as e:
        ck.restore(1, target=bad)
    msg = str(e.value)
    assert "checkpoint step 1 in" in msg and str(tmp_path / "run") in msg
    assert "'params/gptj/wte/embedding' has shape (1024, 64) in the checkpoint, the target wants (10, 64)" in msg
    assert "'params/gptj/ln_f/scale' has dtype float32 in the checkpoint, the target wants bfloat16" in msg
    assert "tensor 'params/missing' is not in the checkpoint" in msg
    with pytest.raises(TypeError, match="leaf 'x' is a str"):
        ck.save(2, {"x": "text"})
    with pytest.raises(ValueError, match="JSON"):
        ck.save(2, {"x": 1}, metadata={"x": object()})
    # corrupted manifest, missing process file, truncated data
    step = tmp_path / "run" / "step_00000001"
    manifest = (step / "manifest.json").read_text()
    (step / "manifest.json").write_text(manifest[: len(manifest) // 2])
    with pytest.raises(ValueError, match="manifest.json is not valid JSON"):
        ck.restore(1)
    (step / "manifest.json").write_text(manifest)
    os.rename(step / "process_00000.json", step / "p.json")
    with pytest.raises(ValueError, match="process_00000.json is missing"):
        ck.restore(1)
    os.rename(step / "p.json", step / "process_00000.json")
    data = next(step.glob("*.safetensors"))
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        ck.restore(1)


# ---- two processes ---------------------------------------------------------------------------------------------

MULTI_SCRIPT = textwrap.dedent('''
    import sys, numpy as np, jax
    pid, port, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_num_cpu_devices", 4)
    from meshtx import distributed
    from meshtx.checkpoint import Checkpointer
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout=60)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "mp"))
    full = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("dp", "mp")), lambda i: full[i])
    r = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P(None, "mp")), lambda i: full[i] * 2)
    ck = Checkpointer(url, keep=None)
    ck.save(1, {"x": x, "r": r, "n": 5})
    back, _ = ck.restore(1, target={"x": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=NamedSharding(mesh, P("mp", "dp")))})
    for s in back["x"].addressable_shards:
        assert (np.asarray(s.data) == full[s.index]).all()
    distributed.sync("done")
    distributed.shutdown()
''')


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_write_their_own_shards(tmp_path):
    script = tmp_path / "multi.py"
    script.write_text(MULTI_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    port, url = str(_free_port()), str(tmp_path / "run")
    logs = [open(tmp_path / f"log{i}", "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, url], env=env, stdout=logs[i],
                              stderr=subprocess.STDOUT) for i in range(2)]
    try:
        for i, p in enumerate(procs):
            if p.wait(90) != 0:
                logs[i].seek(0); pytest.fail(f"process {i} failed: {logs[i].read()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None: p.kill(); p.wait()
        for f in logs: f.close()
    step = tmp_path / "run" / "step_00000001"
    chunks = [json.loads((step / f"process_0000{i}.json").read_text())["chunks"] for i in range(2)]
    boxes = lambda cs, t: sorted(tuple(map(tuple, c["box"])) for c in cs if c["tensor"] == t)
    # x: 8 distinct blocks, 4 from each process; r (replicated over dp): 4 column blocks, written once in all
    assert len(boxes(chunks[0], "x")) == len(boxes(chunks[1], "x")) == 4
    assert len(boxes(chunks[0], "r") + boxes(chunks[1], "r")) == 4
    assert boxes(chunks[1], "n") == [] and len(boxes(chunks[0], "n")) == 1    # host values: process 0 only
    back, _ = Checkpointer(url).restore(1)
    full = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    np.testing.assert_array_equal(back["x"], full); np.testing.assert_array_equal(back["r"], full * 2)
    assert back["n"] == 5


# ---- the original mesh-transformer-jax V1 format ------------------------------------------------------------------

MTJ = "causal_transformer_shard/~/"


def original_shards(params, S, rng, dtype):
    """The original's per-shard haiku params for meshtx `params` (numpy), built the way its modules lay them out.
    Embedding and fc_out biases get random per-shard values (their sum is what the model uses), LayerNorm
    copies on shards > 0 get garbage (the original uses shard 0's). Returns (shards, expected meshtx params)."""
    cast = lambda a: np.asarray(a, np.float32).astype(dtype)
    p = jax.tree.map(lambda a: cast(a).astype(np.float32), jax.tree.map(np.asarray, params))   # representable in dtype
    D, L = CFG.d_model, CFG.n_layer
    emb_b = [cast(rng.normal(size=D)) for _ in range(S)]
    out_b = [[cast(rng.normal(size=D)) for _ in range(S)] for _ in range(L)]
    shards = [{} for _ in range(S)]
    def put(mod, name, parts):
        for s in range(S): shards[s].setdefault(MTJ + mod, {})[name] = cast(parts[s])
    def garbage(first): return [first] + [rng.normal(size=first.shape) for _ in range(S - 1)]
    put("embedding_shard/~/linear", "w", np.split(p["gptj/wte"]["embedding"], S, 0))
    put("embedding_shard/~/linear", "b", emb_b)
    for i in range(L):
        a = p["gptj/blocks/attn"]   # the original's haiku Linear weights are [in, out]: meshtx's transposed
        put(f"layer_{i}/~/linear", "w", np.split(a["q"][i].T, S, 1))      # q
        put(f"layer_{i}/~/linear_1", "w", np.split(a["v"][i].T, S, 1))    # v (created before k in the original)
        put(f"layer_{i}/~/linear_2", "w", np.split(a["k"][i].T, S, 1))    # k
        put(f"layer_{i}/~/linear_3", "w", np.split(a["out"][i].T, S, 0))
        put(f"layer_{i}/~/linear_4", "w", np.split(p["gptj/blocks/mlp/fc_in"]["w"][i].T, S, 1))
        put(f"layer_{i}/~/linear_4", "b", np.split(p["gptj/blocks/mlp/fc_in"]["b"][i], S, 0))
        put(f"layer_{i}/~/linear_5", "w", np.split(p["gptj/blocks/mlp/fc_out"]["w"][i].T, S, 0))
        put(f"layer_{i}/~/linear_5", "b", out_b[i])
        put(f"layer_{i}/~/replicated_layer_norm", "scale", garbage(p["gptj/blocks/ln_1"]["scale"][i]))
        put(f"layer_{i}/~/replicated_layer_norm", "offset", garbage(p["gptj/blocks/ln_1"]["offset"][i]))
    put("projection_shard/~/replicated_layer_norm", "scale", garbage(p["gptj/ln_f"]["scale"]))
    put("projection_shard/~/replicated_layer_norm", "offset", garbage(p["gptj/ln_f"]["offset"]))
    put("projection_shard/~/linear", "w", np.split(p["gptj/lm_head"]["w"].T, S, 1))
    put("projection_shard/~/linear", "b", np.split(p["gptj/lm_head"]["b"], S, 0))
    total = lambda bs: sum((b.astype(np.float32) for b in bs[1:]), bs[0].astype(np.float32))
    expected = jax.tree.map(lambda a: a, p)
    expected["gptj/wte"]["embedding"] = p["gptj/wte"]["embedding"] + total(emb_b)
    expected["gptj/blocks/mlp/fc_out"]["b"] = np.stack([total(out_b[i]) for i in range(L)])
    return shards, expected


def write_original(path, shards, full, rng):
    "Write shard trees exactly as mesh-transformer-jax's write_ckpt: flatten the state, 16 contiguous pieces, np.savez."
    for s, params in enumerate(shards):
        state = {"params": params, "step": np.array(1234)}
        if full:   # the original's optimizer chain, whose state flattens as adam count, mu, nu, schedule count
            opt = optax.chain(optax.scale(1), optax.clip_by_global_norm(1), optax.scale_by_adam(),
                              optax.add_decayed_weights(0.1), optax.scale(-1), optax.scale_by_schedule(lambda n: 1e-4))
            opt_state = opt.init(params)
            opt_state = jax.tree.map(lambda a: np.asarray(rng.normal(size=np.shape(a)), np.asarray(a).dtype), opt_state)
            state["opt_state"] = opt_state
        leaves = [np.asarray(a) for a in jax.tree.leaves(state)]
        leaves = [a.view("V2") if a.dtype == jnp.bfloat16 else a for a in leaves]   # how numpy stored bf16
        os.makedirs(f"{path}/shard_{s}")
        k, m = divmod(len(leaves), 16)
        for i in range(16):
            with open(f"{path}/shard_{s}/{i}.npz", "wb") as f:
                np.savez(f, *leaves[i * k + min(i, m):(i + 1) * k + min(i + 1, m)])
        yield len(leaves)


@pytest.mark.parametrize("full,dtype", [(False, jnp.bfloat16), (True, np.float32)])
def test_load_original_checkpoint(tmp_path, full, dtype):
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: np.asarray(a) + rng.normal(size=a.shape).astype(np.float32) * 0.1, init_params(CFG, seed=4))
    shards, expected = original_shards(params, 2, rng, dtype)
    counts = set(write_original(tmp_path / "step_1234", shards, full, rng))
    assert counts == {81 if full else 27}      # 3·(10L+6)+3 and 10L+7 for L=2 (861 / 287 for GPT-J's 28)
    loaded = load_mtj_checkpoint(tmp_path / "step_1234", CFG)
    assert_trees_equal(jax.tree.map(np.asarray, loaded), expected)
    mesh = make_mesh(2, 1, 4, config=CFG)
    on_mesh = load_mtj_checkpoint(str(tmp_path / "step_1234"), CFG, shardings=param_shardings(CFG, mesh))
    assert on_mesh["gptj/blocks/attn"]["q"].sharding == param_shardings(CFG, mesh)["gptj/blocks/attn"]["q"]
    assert_trees_equal(jax.tree.map(np.asarray, on_mesh), expected)
    bf16 = load_mtj_checkpoint(tmp_path / "step_1234", CFG.replace(param_dtype="bfloat16"))
    assert bf16["gptj/wte"]["embedding"].dtype == jnp.bfloat16


def test_original_checkpoint_errors(tmp_path):
    rng = np.random.default_rng(0)
    shards, _ = original_shards(jax.tree.map(np.asarray, init_params(CFG)), 2, rng, jnp.bfloat16)
    list(write_original(tmp_path / "ckpt", shards, False, rng))
    with pytest.raises(ValueError, match=r"holds 27 leaves per shard, but for n_layer=3 a slim checkpoint has 37 and a full one 111"):
        load_mtj_checkpoint(tmp_path / "ckpt", CFG.replace(n_layer=3))
    with pytest.raises(ValueError, match=r"shard_0/\d+\.npz: .* has shape \(\d+, \d+\), but the config .* split over 2 shards expects"):
        load_mtj_checkpoint(tmp_path / "ckpt", CFG.replace(d_model=32))
    with pytest.raises(ValueError, match="n_vocab=1023 is not divisible by the checkpoint's 2 shards"):
        load_mtj_checkpoint(tmp_path / "ckpt", CFG.replace(n_vocab=1023))
    with pytest.raises(ValueError, match="no shard_0/"):
        load_mtj_checkpoint(tmp_path, CFG)
    with pytest.raises(ValueError, match="does not exist"):
        load_mtj_checkpoint(tmp_path / "nope", CFG)


def test_original_checkpoint_with_an_object_array_names_the_file(tmp_path):
    "An npz leaf that is pickled Python (an object array) is refused, naming the file and array; nothing is unpickled."
    rng = np.random.default_rng(0)
    shards, _ = original_shards(jax.tree.map(np.asarray, init_params(CFG)), 2, rng, jnp.bfloat16)
    list(write_original(tmp_path / "ckpt", shards, False, rng))
    with np.load(tmp_path / "ckpt" / "shard_1" / "0.npz") as z: arrays = {k: z[k] for k in z.files}
    arrays["arr_0"] = np.array([{"not": "numbers"}] * 2, dtype=object)
    np.savez(tmp_path / "ckpt" / "shard_1" / "0.npz", **arrays)
    with pytest.raises(ValueError, match=r"shard_1/0\.npz: array 'arr_0' cannot be read as numbers"):
        load_mtj_checkpoint(tmp_path / "ckpt", CFG)


def test_convert_original_checkpoint_to_hf(tmp_path):
    "`meshtx convert step_N/ out --mtj-config run.json` gives a Hugging Face checkpoint with the original's weights."
    import json
    from meshtx.cli import main
    from meshtx.lm import LM
    rng = np.random.default_rng(1)
    shards, expected = original_shards(jax.tree.map(np.asarray, init_params(CFG, seed=5)), 2, rng, np.float32)
    list(write_original(tmp_path / "step_7", shards, False, rng))
    run = {"layers": CFG.n_layer, "d_model": CFG.d_model, "n_heads": CFG.n_head, "n_vocab": CFG.n_vocab,
           "seq": CFG.n_ctx, "pe_rotary_dims": CFG.rotary_dim, "cores_per_replica": 2, "lr": 1e-4}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert main(["convert", tmp_path / "step_7", tmp_path / "hf", "--mtj-config", tmp_path / "run.json", "-q"]) == 0
    back = LM.from_hf(tmp_path / "hf", dtype="float32", tokenizer=None, progress=False)
    assert_trees_equal(jax.tree.map(np.asarray, back.params), expected)


def test_training_checkpoint_of_the_earlier_layout(tmp_path):
    "A full fine-tune's checkpoint from before weight matrices were [out, in] (a fused qkv): LM.load converts its "
    "weights; a Trainer refuses to continue it, and says what to do."
    import itertools
    from meshtx import LM, Trainer
    lm = LM.init("tiny")
    old = {f"{m}/{p}": np.asarray(v) for m, ps in lm.params.items() for p, v in ps.items()}
    old["gptj/blocks/attn/qkv"] = np.stack([old.pop(f"gptj/blocks/attn/{t}").transpose(0, 2, 1) for t in "qkv"], axis=2)
    for k in ("gptj/blocks/attn/out", "gptj/blocks/mlp/fc_in/w", "gptj/blocks/mlp/fc_out/w"): old[k] = old[k].transpose(0, 2, 1)
    old["gptj/lm_head/w"] = old["gptj/lm_head/w"].T
    tree = {}
    for k, v in old.items(): tree.setdefault(k.rsplit("/", 1)[0], {})[k.rsplit("/", 1)[1]] = jnp.asarray(np.ascontiguousarray(v))
    Checkpointer(tmp_path / "run").save(5, {"params": tree, "step": jnp.asarray(5)}, metadata={"config": lm.config.to_dict(), "lora": None})
    back = LM.load(tmp_path / "run")
    assert_trees_equal(jax.tree.map(np.asarray, back.params), jax.tree.map(np.asarray, lm.params))
    t = Trainer(LM.init("tiny"), itertools.repeat(np.zeros((1, 2, 9), np.int32)), progress=False)
    with pytest.raises(ValueError, match="earlier meshtx.*LM.load"): t.restore(tmp_path / "run", 5)
