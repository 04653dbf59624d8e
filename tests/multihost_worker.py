"""One process of a multi-process training step (run by test_multihost.py).

usage: python multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON
Every process drives 8 / NUM_PROCESSES CPU devices; together they form one 2 x 2 x 2 mesh, take one AdamW
step on the same global batch (each process feeding its own rows) and process 0 writes the loss."""
import json, os, sys
pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
import jax
jax.config.update("jax_num_cpu_devices", 8 // nproc)
import numpy as np, optax, jax.numpy as jnp
from meshtx import distributed, ModelConfig, init_params, gptj
from meshtx.model import cross_entropy
from meshtx.sharding import make_mesh, param_shardings, opt_state_shardings, activation_hint

if nproc > 1:
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout=60)
if os.environ.get("MESHTX_TEST_DIE") == str(pid):
    os._exit(3)                                   # simulate a crashed host (no atexit, no goodbye)
assert len(jax.devices()) == 8 and jax.local_device_count() == 8 // nproc

cfg = ModelConfig(n_layer=2, d_model=64, n_head=8, rotary_dim=4, n_vocab=512, n_ctx=64)
mesh = make_mesh(2, 2, 2, config=cfg)
p_sh = param_shardings(cfg, mesh)
params = init_params(cfg, 0, p_sh)
opt = optax.adamw(1e-3)
o_sh = opt_state_shardings(opt, params, p_sh, mesh)
opt_state = jax.jit(opt.init, out_shardings=o_sh)(params)
model = gptj(cfg, activation_hint(mesh))

def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, sum(jnp.sum(x) for x in jax.tree.leaves(params))

tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (8, 17)).astype(np.int32)   # the global batch
batch = distributed.global_batch(tokens[distributed.process_rows(8)], mesh)               # this process's rows
params, opt_state, loss, checksum = jax.jit(step, out_shardings=(p_sh, o_sh, None, None), donate_argnums=(0, 1))(params, opt_state, batch)
loss.block_until_ready()
if distributed.is_main_process():
    with open(out, "w") as f: json.dump({"loss": float(loss), "checksum": float(checksum), "processes": jax.process_count()}, f)
distributed.sync("done")
distributed.shutdown()
