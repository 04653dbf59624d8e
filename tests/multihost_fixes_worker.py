"""One process of a small multi-process job checking one thing (run by test_multihost.py).

usage: python multihost_fixes_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON WORKDIR MODE
One CPU device per process. WORKDIR holds a tiny model (`hf`: Hugging Face format, `mx`: meshtx's) and `docs.txt`.
MODE: load (without a mesh, then onto the job's mesh), share, batch (global_batch on meshes), save, finetune.
Every process writes what it saw to OUT_JSON.PROCESS_ID; process 0 then writes OUT_JSON."""
import json, sys
pid, nproc, port, out, work, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
import jax
jax.config.update("jax_num_cpu_devices", 1)
import numpy as np
from meshtx import distributed, LM
from meshtx.sharding import make_mesh

if nproc > 1:
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout=60)
res = {"processes": jax.process_count()}
gen = lambda lm: lm.generate([[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=0.0, eos_token_id=None).tokens
if mode == "load":
    # lm.shard moves such a model onto the job's mesh (by way of host memory), as `meshtx train` and `finetune` do
    for name, load in (("hf", lambda: LM.from_hf(f"{work}/hf", dtype="float32", progress=False)),
                       ("mx", lambda: LM.load(f"{work}/mx", progress=False))):
        lm = load()
        res[name] = gen(lm)
        res[name + "_sharded"] = gen(lm.shard(make_mesh(config=lm.config)))   # onto the job's mesh: both processes' devices
elif mode == "share":
    res["big"] = distributed.share(2**31 + 7 if pid == 0 else 0)
    res["negative"] = distributed.share(-2**40 if pid == 0 else 5)
    try: distributed.share(1.5)
    except TypeError as e: res["float"] = str(e)
    res["after"] = distributed.share(3 if pid == 0 else 4)   # the job goes on
elif mode == "batch":
    tokens = np.arange(8 * 3).reshape(8, 3).astype(np.int32)
    whole = jax.sharding.PartitionSpec()
    for name, kw in (("dp", {}), ("mp", dict(mp=2)), ("fsdp", dict(fsdp=2))):
        mesh = make_mesh(**kw)
        b = distributed.global_batch(tokens[distributed.process_rows(8)], mesh)
        res[name] = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(mesh, whole))(b).tolist()
elif mode == "save":
    lm = LM.from_hf(f"{work}/hf", dtype="float32", mesh=make_mesh(fsdp=nproc), progress=False)
    res["split"] = any(not x.is_fully_addressable for x in jax.tree.leaves(lm.params))
    res["hf"] = str(lm.save_hf(f"{work}/out-hf", progress=False))
    res["mx"] = str(lm.save(f"{work}/out-mx"))
    res["merged"] = str(lm.add_lora(4).merge_lora().save_hf(f"{work}/out-merged", progress=False))
elif mode == "finetune":
    from meshtx.runs import finetune
    logs = []
    lm = LM.from_hf(f"{work}/hf", dtype="float32", mesh=make_mesh(), progress=False)
    r = finetune(lm, f"{work}/docs.txt", f"{work}/ft", steps=2, batch=4, seq=32, val_fraction=0.003,
                 progress=False, log=lambda *a: logs.append(" ".join(map(str, a))))
    res.update(result=r, logs=logs)
with open(f"{out}.{pid}", "w") as f: json.dump(res, f)
distributed.sync("done")
if distributed.is_main_process():
    with open(out, "w") as f: json.dump(res, f)
distributed.shutdown()
