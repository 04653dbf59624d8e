"""XLA:TPU's memory analysis of training steps (full, or LoRA given a rank), for `meshtx.plan`'s TPU rules (nothing is allocated):

    python tpu_steps.py topo                      # can this JAX compile for a v5e-8 it does not have?
    python tpu_steps.py list '[["llama-3.2-1b", 1, 2048, "bfloat16", null], ...]'   # preset, batch, seq, dtype, layers
    python tpu_steps.py aot '{"topology_name": "v5e:2x4"}' '[["gptj-6b", 8, 2048, "bfloat16", 8, 1, null], ...]'
                                                  # ... fsdp, mp, layers (dp: the rest): Kaggle's v5e-8 from one chip;
                                                  # an 8th item, a rank, makes it a LoRA step

Each result is a line `ROW {json}` (GiB per chip: XLA's total = arguments + outputs - aliases + temporaries). The
figures in tests/test_sharding.py's TPU_V5E_FULL_STEPS and TPU_V5E_LORA_MESH_STEPS came from these (bench/RESULTS.md,
2026-12-06)."""
import json, sys, time
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import meshtx
from memory import step_memory
from meshtx.sharding import plan, make_mesh, param_shardings, opt_state_shardings, batch_sharding
from meshtx.model import param_shapes, gptj
from meshtx.train import make_optimizer, make_train_step, TrainState, step_options

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

def compiled_step(cfg, devs, B, T, dtype, fsdp, mp, lora=0, device="tpu-v5e"):
    """XLA's memory analysis (GiB per device: total, temporaries, arguments) of one full (`lora=0`) or LoRA (rank `lora`)
    training step of `cfg` on `devs`, laid out as the `Trainer` lays it out, and `plan`'s figure for it on `device`."""
    from meshtx import LoRAConfig
    from meshtx.lora import split_adapters
    mode = "lora" if lora else "train"
    # a mesh meshtx itself would build (with config=: an mp that does not divide the heads is refused, as in `plan`)
    mesh = make_mesh(dp=len(devs) // (fsdp * mp), fsdp=fsdp, mp=mp, devices=devs, config=cfg, mode=mode)
    lcfg = LoRAConfig(rank=lora) if lora else None
    rep = NamedSharding(mesh, P())
    if lora:   # the frozen base laid out by the partition rules, the float32 adapters replicated (`init_lora`)
        frozen, trainable = split_adapters(jax.eval_shape(gptj(cfg, lora=lcfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
        f_sh, p_sh = param_shardings(frozen, mesh), jax.tree.map(lambda _: rep, trainable)
        opt = make_optimizer()
    else:
        frozen, trainable, f_sh = {}, param_shapes(cfg), {}
        p_sh = param_shardings(cfg, mesh)
        opt = make_optimizer(mu_dtype=dtype)
    o_sh = opt_state_shardings(opt, trainable, p_sh, mesh)
    state = TrainState(trainable, jax.eval_shape(opt.init, trainable), jax.ShapeDtypeStruct((), jnp.int32))
    step = make_train_step(cfg, opt, mesh, lcfg)
    tok_sh = NamedSharding(mesh, P(None, *batch_sharding(mesh, (B, T + 1)).spec))
    st_sh = TrainState(p_sh, o_sh, rep)
    j = jax.jit(step, in_shardings=(st_sh, tok_sh, f_sh), out_shardings=(st_sh, None), donate_argnums=0,
                compiler_options=step_options())   # as the Trainer compiles it (JAX's backend's options)
    m = j.lower(state, jax.ShapeDtypeStruct((1, B, T + 1), jnp.int32), frozen).compile().memory_analysis()
    tot = m.argument_size_in_bytes + m.output_size_in_bytes - getattr(m, "alias_size_in_bytes", 0) + m.temp_size_in_bytes
    kw = dict(lora_rank=lora) if lora else dict(opt_dtype=dtype)
    pl = plan(cfg, mesh, mode, B, T, device=device, param_dtype=dtype, remat=True, **kw).total
    return dict(xla=tot / 2**30, temps=m.temp_size_in_bytes / 2**30, args=m.argument_size_in_bytes / 2**30,
                plan=pl / 2**30, plan_over_xla=pl / tot)

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

if __name__ == "__main__":
    part = sys.argv[1]
    if part == "topo":
        from jax.experimental import topologies
        for kw in (dict(topology_name="v5e:2x4"), dict(topology_name="v5e:2x2")):
            try: t = topologies.get_topology_desc(platform="tpu", **kw); print("TOPO ok", kw, len(t.devices), t.devices[0].device_kind, flush=True)
            except Exception as e: print("TOPO fail", kw, type(e).__name__, str(e)[:300], flush=True)
    elif part == "list":
        for name, B, T, dtype, layers in json.loads(sys.argv[2]): single(name, B, T, dtype, layers)
    elif part == "aot":
        kw = json.loads(sys.argv[2])
        for name, B, T, dtype, fsdp, mp, layers, *lora in json.loads(sys.argv[3]):
            aot(name, B, T, dtype, fsdp, mp, kw, layers, *lora)
