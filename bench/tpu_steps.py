"""XLA:TPU's memory analysis of training steps (full, or LoRA given a rank), for `meshtx.plan`'s TPU rules (nothing is allocated):

    python tpu_steps.py topo                      # can this JAX compile for a v5e-8 it does not have?
    python tpu_steps.py list '[["llama-3.2-1b", 1, 2048, "bfloat16", null], ...]'   # preset, batch, seq, dtype, layers
    python tpu_steps.py compiled '[["gptj-6b", "lora", 1, 2048, "bfloat16", 1, 1, 8, null, 13.156], ...]'
                                                  # meshtx.compiled.compiled_memory against the figures above
    python tpu_steps.py aot '{"topology_name": "v5e:2x4"}' '[["gptj-6b", 8, 2048, "bfloat16", 8, 1, null], ...]'
                                                  # ... fsdp, mp, layers (dp: the rest): Kaggle's v5e-8 from one chip;
                                                  # an 8th item, a rank, makes it a LoRA step
    python tpu_steps.py tables [JOBS [i/n]]       # every TPU step tests/test_sharding.py holds (or the i-th of n slices),
                                                  # compiled again for its topology (v5e:1x1 or v5e:2x4) in JOBS processes

Each result is a line `ROW {json}` (GiB per chip: XLA's total = arguments + outputs - aliases + temporaries). The
figures in tests/test_sharding.py's TPU_V5E_FULL_STEPS and TPU_V5E_LORA_MESH_STEPS came from these (bench/RESULTS.md,
2026-12-06)."""
import json, sys, time
import meshtx
from memory import step_memory
from meshtx.sharding import plan

def emit(**kw): print("ROW " + json.dumps(kw), flush=True)

def single(name, B, T, dtype="bfloat16", layers=None):
    cfg = meshtx.ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
    if layers: cfg = cfg.replace(n_layer=layers)
    try:
        t0 = time.time(); m = step_memory(cfg, B, T)
        pl = plan(cfg, 1, "train", B, T, device="tpu-v5e", param_dtype=dtype, opt_dtype=dtype, remat=True).total / 2**30
        emit(kind="single", name=name, B=B, T=T, dtype=dtype, layers=layers, xla=m["total"] / 2**30, plan=pl, plan_over_xla=pl / m["total"] * 2**30,
             temps=m["temporaries"] / 2**30, args=m["arguments"] / 2**30, s=round(time.time() - t0, 1))
    except Exception as e: emit(kind="single", name=name, B=B, T=T, dtype=dtype, layers=layers, error=str(e)[:300])

def compiled_step(cfg, devs, B, T, dtype, fsdp, mp, lora=0):
    """XLA's memory analysis (GiB per device: total, temporaries, arguments) of one full (`lora=0`) or LoRA (rank `lora`)
    training step of `cfg` on `devs` (`meshtx.compiled.compiled_memory`: the `Trainer`'s step), and `plan`'s figure."""
    from meshtx.compiled import compiled_memory
    kw = dict(lora_rank=lora) if lora else dict(opt_dtype=dtype)
    c = compiled_memory(cfg, len(devs), "lora" if lora else "train", B, T, param_dtype=dtype, compute_dtype=cfg.compute_dtype,
                        remat=cfg.remat, dp=len(devs) // (fsdp * mp), fsdp=fsdp, mp=mp, devices=devs, **kw)
    return dict(xla=c.total / 2**30, temps=c.temporaries / 2**30, args=c.arguments / 2**30, plan=c.plan.total / 2**30,
                plan_over_xla=c.plan.total / c.total)

def aot(name, B, T, dtype, fsdp=8, mp=1, topo_kw=None, layers=None, lora=0):
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="tpu", **topo_kw)
        cfg = meshtx.ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
        if layers: cfg = cfg.replace(n_layer=layers)
        t0 = time.time()
        r = compiled_step(cfg, topo.devices, B, T, dtype, fsdp, mp, lora)
        emit(kind="aot", topo=str(topo_kw), name=name, B=B, T=T, dtype=dtype, fsdp=fsdp, mp=mp, layers=layers, lora=lora,
             n_dev=len(topo.devices), kind_=topo.devices[0].device_kind, **r, s=round(time.time() - t0, 1))
    except Exception as e:
        emit(kind="aot", name=name, B=B, T=T, dtype=dtype, topo=str(topo_kw), lora=lora, error=f"{type(e).__name__}: {str(e)[:500]}")

def compiled(rows):
    """`meshtx.compiled.compiled_memory` on this chip (`topo` None) or a topology's devices, each row beside the figure
    measured before by the code above (`before`, GiB per chip, or None): (preset, mode, B, T, dtype, fsdp, mp, rank, topo, before)."""
    from meshtx.compiled import compiled_memory, tpu_topology
    for name, mode, B, T, dtype, fsdp, mp, rank, topo, before in rows:
        try:
            devices = tpu_topology(topo) if topo else None
            n = len(devices) if devices else 1
            kw = dict(lora_rank=rank) if mode == "lora" else dict(opt_dtype=dtype)
            t0 = time.time()
            c = compiled_memory(name, n, mode, B, T, param_dtype=dtype, remat=True, dp=n // (fsdp * mp), fsdp=fsdp, mp=mp, devices=devices, **kw)
            emit(kind="compiled", name=name, mode=mode, B=B, T=T, dtype=dtype, fsdp=fsdp, mp=mp, topo=topo, xla=c.total / 2**30,
                 before=before, same=None if before is None else abs(c.total / 2**30 - before) < 0.0015, plan=c.plan.total / 2**30,
                 plan_over_xla=round(c.plan.total / c.total, 3), s=round(time.time() - t0, 1))
        except Exception as e: emit(kind="compiled", name=name, mode=mode, topo=topo, error=f"{type(e).__name__}: {str(e)[:500]}")

def recorded_points(path=None):
    """The TPU steps tests/test_sharding.py holds, read from its source (nothing imported), each as
    (table, preset, layers, mode, dtype, batch, seq, dp, fsdp, mp, recorded GiB)."""
    import ast, pathlib
    path = path or pathlib.Path(__file__).parent.parent / "tests" / "test_sharding.py"
    tables = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(open(path).read()).body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id.startswith("TPU_")}
    pts = [("TPU_V5E_STEPS", n, None, m, "bfloat16", B, T, 1, 1, 1, x) for n, m, B, T, x in tables["TPU_V5E_STEPS"]]
    pts += [("TPU_V5E_FULL_STEPS", n, L, "train", d, B, T, dp, f, mp, x) for n, L, d, B, T, dp, f, mp, x in tables["TPU_V5E_FULL_STEPS"]]
    pts += [("TPU_V5E_LORA_MESH_STEPS", n, None, "lora", "bfloat16", B, T, dp, f, mp, x) for n, B, T, dp, f, mp, x in tables["TPU_V5E_LORA_MESH_STEPS"]]
    pts += [("TPU_V5E8_COMPILED_HERE", n, None, m, d, B, T, dp, f, mp, x) for n, m, d, B, T, dp, f, mp, x in tables["TPU_V5E8_COMPILED_HERE"]]
    return pts

def points(pts):
    "Each recorded point compiled again (`compiled_memory` for a v5e topology, LoRA rank 8): a ROW with XLA's GiB now."
    from meshtx.compiled import compiled_memory, tpu_topology
    for table, name, layers, mode, dtype, B, T, dp, fsdp, mp, before in pts:
        try:
            cfg = meshtx.ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
            cfg = cfg.replace(n_layer=layers) if layers else cfg
            n = dp * fsdp * mp
            kw = dict(lora_rank=8) if mode == "lora" else dict(opt_dtype=dtype)
            t0 = time.time()
            c = compiled_memory(cfg, n, mode, B, T, param_dtype=dtype, remat=True, dp=dp, fsdp=fsdp, mp=mp,
                                devices=tpu_topology("v5e:1x1" if n == 1 else "v5e:2x4"), **kw)
            emit(kind="table", table=table, name=name, layers=layers, mode=mode, dtype=dtype, B=B, T=T, dp=dp, fsdp=fsdp, mp=mp,
                 before=before, xla=round(c.total / 2**30, 4), plan=round(c.plan.total / 2**30, 4),
                 plan_over_xla=round(c.plan.total / c.total, 3), s=round(time.time() - t0, 1))
        except Exception as e: emit(kind="table", table=table, name=name, error=f"{type(e).__name__}: {str(e)[:300]}")

def tables(jobs, share="0/1"):
    """`points` over every recorded point (`share` "i/n": the i-th of n slices), in `jobs` processes at once, each
    printing its rows as they come (compiling needs no chip: JAX_PLATFORMS=cpu)."""
    import os, subprocess
    i, n = map(int, share.split("/"))
    pts = recorded_points()[i::n]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}   # no lockfile
    procs = [subprocess.Popen([sys.executable, __file__, "points", json.dumps(pts[j::jobs])], env=env, stderr=subprocess.DEVNULL)
             for j in range(jobs)]
    for p in procs: p.wait()

if __name__ == "__main__":
    part = sys.argv[1]
    if part == "topo":
        from jax.experimental import topologies
        for kw in (dict(topology_name="v5e:2x4"), dict(topology_name="v5e:2x2")):
            try: t = topologies.get_topology_desc(platform="tpu", **kw); print("TOPO ok", kw, len(t.devices), t.devices[0].device_kind, flush=True)
            except Exception as e: print("TOPO fail", kw, type(e).__name__, str(e)[:300], flush=True)
    elif part == "list":
        for name, B, T, dtype, layers in json.loads(sys.argv[2]): single(name, B, T, dtype, layers)
    elif part == "compiled":
        compiled(json.loads(sys.argv[2]))
    elif part == "points":
        points(json.loads(sys.argv[2]))
    elif part == "tables":
        tables(*([int(sys.argv[2])] + sys.argv[3:4]) if len(sys.argv) > 2 else [4])
    elif part == "aot":
        kw = json.loads(sys.argv[2])
        for name, B, T, dtype, fsdp, mp, layers, *lora in json.loads(sys.argv[3]):
            aot(name, B, T, dtype, fsdp, mp, kw, layers, *lora)
