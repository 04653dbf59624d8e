"""One process of a multi-process `Trainer` whose global batch does not divide over the mesh (run by test_multihost.py).

usage: python multihost_odd_batch_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON
The processes share 4 CPU devices as one fsdp=4 mesh. Global batches of 6 rows (2 micro-batches) and 2 validation
rows do not split 4 ways, so they are replicated; each process still passes only its own rows. Process 0 writes
the losses to OUT_JSON."""
import json, sys
pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
import jax
jax.config.update("jax_num_cpu_devices", 4 // nproc)
import numpy as np
from meshtx import distributed, LM, ModelConfig
from meshtx.sharding import make_mesh
from meshtx.train import Trainer

if nproc > 1:
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout=60)
cfg = ModelConfig(n_layer=1, d_model=64, n_head=4, rotary_dim=8, d_ff=128, n_vocab=500, n_ctx=64)
rng = np.random.default_rng(0)
train = [rng.integers(0, 500, (2, 6, 17)).astype(np.int32) for _ in range(2)]   # [accum, rows, seq + 1]
val = rng.integers(0, 500, (1, 2, 17)).astype(np.int32)
rows, val_rows = distributed.process_rows(6), distributed.process_rows(2)
lm = LM.init(cfg, seed=0, tokenizer=None, mesh=make_mesh(dp=1, fsdp=4, mp=1, config=cfg))
t = Trainer(lm, iter([b[:, rows] for b in train]), lr=1e-2, progress=False)
losses = [t.step()["loss"] for _ in range(2)]
result = {"losses": losses, "val": t.evaluate([val[:, val_rows]]), "processes": jax.process_count()}
if distributed.is_main_process():
    with open(out, "w") as f: json.dump(result, f)
distributed.sync("done")
distributed.shutdown()
