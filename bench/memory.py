"""Device memory of a training step as XLA's buffer assignment counts it: arguments, outputs and temporaries of
the compiled step, at any shape, on any machine, without allocating anything (parameters are abstract). This is
the compiler's plan, not a measured peak: on a GPU, `train.py` reports the measured peak next to it. HF has no
equivalent (PyTorch allocates eagerly), so there is no HF column.

Rows: a LoRA step (frozen base, float32 adapters, rank 8 on q,k,v,out,fc_in,fc_out) at `--batch` 1, and a full
step (weights and Adam moments in the benchmark dtype), each with remat policies "nothing" and "dots" and without.

On one CPU the LoRA step is compiled as the `Trainer` runs it there: the frozen blocks one layer at a time. Given
the stacked blocks, XLA:CPU converts each whole bf16 stack to float32 before the layer loop (measured: Llama-3.2-1B's
LoRA step at 1 × 512 had 4.2 GiB of temporaries that way, 0.55 GiB as the Trainer runs it)."""
from common import parser, config, report, default_dtype


def step_memory(cfg, batch: int, seq: int, lora: int = 0) -> dict:
    """XLA's memory analysis of one compiled train step (bytes): `meshtx.compiled.compiled_memory` of the `Trainer`'s
    step on one device, in `cfg`'s dtypes and remat (a full step's Adam moments in the weights' dtype)."""
    from meshtx.compiled import compiled_memory
    kw = dict(lora_rank=lora) if lora else dict(opt_dtype=cfg.param_dtype)
    c = compiled_memory(cfg, 1, "lora" if lora else "train", batch, seq, param_dtype=cfg.param_dtype,
                        compute_dtype=cfg.compute_dtype, remat=cfg.remat, **kw)
    return dict(arguments=c.arguments, temporaries=c.temporaries, total=c.total)


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="LoRA batch (the full step uses 4 × this)")
    args = p.parse_args(argv)
    dtype = default_dtype(args)
    base = config(args).replace(param_dtype=dtype, compute_dtype=dtype)
    rows = []
    for name, lora, batch in (("LoRA step", 8, args.batch), ("full step", 0, 4 * args.batch)):
        for remat in (None, "nothing", "dots"):
            cfg = base.replace(remat=remat is not None, remat_policy=remat or "nothing")
            m = step_memory(cfg, batch, args.seq, lora)
            label = f"{name}, batch {batch} × {args.seq}, " + (f"remat {remat}" if remat else "no remat")
            rows.append(dict(figure=label + " (total)", meshtx=m["total"] / 2**30, unit="GiB", lower_is_better=True))
            rows.append(dict(figure=label + " (temporaries)", meshtx=m["temporaries"] / 2**30, unit="GiB", lower_is_better=True))
    report("memory", rows, args, f"(XLA buffer assignment of the compiled step on this backend; {dtype} weights; "
                                 "nothing allocated. total = arguments + outputs − donated aliases + temporaries)")
    return rows


if __name__ == "__main__": main()
