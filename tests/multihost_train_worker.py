"""One process of a multi-process fine-tune through `Trainer` (run by test_multihost.py).

usage: python multihost_train_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON WORKDIR
The processes share 8 CPU devices as one dp=2 x fsdp=4 mesh; each loads only its rows of every batch from a
prepared dataset in WORKDIR/data, trains 3 steps, evaluates, saves a checkpoint into WORKDIR/ckpt-N
(every process writing its own shards) and generates. Process 0 writes the losses and tokens to OUT_JSON."""
import json, sys
pid, nproc, port, out, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
import jax
jax.config.update("jax_num_cpu_devices", 8 // nproc)
from meshtx import distributed, LM, ModelConfig
from meshtx.data import TokenData, Loader
from meshtx.sharding import make_mesh
from meshtx.train import Trainer

if nproc > 1:
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout=60)
cfg = ModelConfig(n_layer=2, d_model=64, n_head=8, rotary_dim=4, n_vocab=257, n_ctx=64)
lm = LM.init(cfg, seed=1, tokenizer=None, mesh=make_mesh(dp=2, fsdp=4, mp=1, config=cfg))
data = TokenData.open(f"{work}/data")
t = Trainer(lm, Loader(data, batch=8, accum=2, seed=3), Loader(data, batch=8, split="val"), lr=1e-3,
            checkpoint_dir=f"{work}/ckpt-{nproc}", progress=False)
losses = [t.step()["loss"] for _ in range(3)]
val = t.evaluate()
t.save()
# generation with its rows split over the processes' devices: every process gets every row
opts = dict(max_new_tokens=5, temperature=[0.0, 1.0], seed=[0, 1], eos_token_id=None)
generated = lm.generate([[1, 2, 3], [4, 5, 6, 7]], **opts).tokens
stream = lm.generate([[1, 2, 3], [4, 5, 6, 7]], stream=True, **opts)
for _ in stream: pass
if distributed.is_main_process():
    with open(out, "w") as f:
        json.dump({"losses": losses, "val": val, "processes": jax.process_count(), "generated": generated,
                   "streamed": stream.tokens}, f)
distributed.sync("done")
distributed.shutdown()
