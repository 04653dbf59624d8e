"""meshtx on a TPU chip (or any accelerator JAX sees): is it right there, how fast, and does `plan` hold?

    python bench/tpu.py parity [--quick | --variants A,B] [--json F]   # tiny configs of every family: the chip against the CPU
    python bench/tpu.py row PRESET MODE [--seq S] [--json F]   # one real shape, random bf16 weights, in its own process
    python bench/tpu.py plan PRESET... [--seq S] [--batch B]    # `plan` against XLA's compiled memory analysis (abstract)
    python bench/tpu.py infer-plan PRESET... [--shapes BxPxS,...]   # `plan(prompt=)` against XLA's for generate's prefill
    python bench/tpu.py loss PRESET... [--seq S] [--layers N]   # the training loss's share of XLA's step, per backend

`parity` runs itself twice: once with `JAX_PLATFORMS=cpu` (the reference, float32), then on the chip, where it
compares, per family variant: float32 logits at JAX's highest matmul precision, greedy tokens of a padded batch,
the losses of three LoRA steps and of two full fine-tune steps; and the bf16 logits' argmax against float32's.

`row` measures one of: `infer` (greedy `generate`, batch 1 and `--batch`, `--prompt` tokens then `--new`: tokens/s after a compiling
run, against the limit the chip's measured read bandwidth sets), `lora` (a rank-8 LoRA step at batch 1 × `--seq`,
remat) or `train` (a full step, bf16 weights and Adam moments, remat). Each row reports the chip's peak memory (the
allocator's `peak_bytes_in_use`) next to `meshtx.plan(..., device=...)` for the same work. One row per process: the
peak counter cannot be reset."""
import argparse, json, os, subprocess, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent)); sys.path.insert(0, str(HERE))


def variants():
    from meshtx import ModelConfig
    gptj = ModelConfig(n_layer=2, d_model=64, n_head=4, d_head=16, rotary_dim=8, n_vocab=300, n_ctx=128)
    llama = ModelConfig(family="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=2, n_vocab=300, n_ctx=128, rotary_base=500.0)
    neox = ModelConfig(family="gpt_neox", n_layer=2, d_model=64, n_head=4, n_vocab=300, n_ctx=128)
    return {"gptj": gptj, "llama gqa": llama, "llama tied mqa": llama.replace(n_kv_head=1, tie_embeddings=True),
            "llama3 rope": llama.replace(rope_scaling="llama3", rope_factor=8.0, rope_original_ctx=16),
            "mistral window 7": llama.replace(family="mistral", sliding_window=7),
            "qwen2 biases": llama.replace(family="qwen2", qkv_bias=True, ln_eps=1e-6),
            "qwen2 window on the last layer": llama.replace(family="qwen2", qkv_bias=True, sliding_window=7, sliding_window_from=1),
            "neox parallel": neox, "neox sequential": neox.replace(parallel_residual=False, rotary_dim=8)}


def scaled(lm, dtype="float32"):
    """`lm` with its matrices ×10 (std 0.2, as the parity tests do: HF's std 0.02 makes every logit nearly 0 and an argmax
    comparison vacuous), in `dtype`."""
    import jax, jax.numpy as jnp
    from meshtx import LM
    from meshtx.lm import _with_dtype
    params = jax.tree.map(lambda x: (x * 10 if x.ndim >= 2 else x).astype(dtype), lm.params)
    return LM(_with_dtype(lm.config, dtype, dtype), params, None)


QUICK = ("gptj", "llama gqa", "mistral window 7", "qwen2 window on the last layer", "neox parallel")

def chosen(args) -> list:
    "The variants `parity` runs: `--variants`, or `QUICK`'s five with `--quick`, or all."
    names = args.variants.split(",") if args.variants else QUICK if args.quick else list(variants())
    unknown = [n for n in names if n not in variants()]
    if unknown: raise SystemExit(f"unknown variants {unknown}; known: {list(variants())}")
    return names

def parity_results(names, dtype="float32", full=True) -> dict:
    "Every number the comparison needs, computed on this process's default backend."
    import itertools, numpy as np, jax
    from meshtx import LM, Trainer
    jax.config.update("jax_default_matmul_precision", "highest")
    out, rng = {}, np.random.default_rng(0)
    tokens = rng.integers(0, 300, (2, 24))
    batches = rng.integers(0, 300, (4, 1, 2, 33))
    for name, cfg in variants().items():
        if name not in names: continue
        print(f"  {jax.default_backend()} {dtype}: {name}", file=sys.stderr, flush=True)
        lm = scaled(LM.init(cfg, seed=1, dtype="float32", tokenizer=None), dtype)
        out[f"{name}/logits"] = np.asarray(lm.logits(tokens), np.float32)
        g = lm.generate([[5, 6, 7], list(range(10, 22))], max_new_tokens=16, temperature=0, eos_token_id=None)
        out[f"{name}/greedy"] = np.array(g.tokens)
        if dtype != "float32": continue
        for what, kw in (("lora", dict(lora=8)), ("full", dict(param_dtype="float32")))[:2 if full else 1]:
            t = Trainer(scaled(LM.init(cfg, seed=1, dtype="float32", tokenizer=None)), iter(batches), lr=1e-2, progress=False, **kw)
            out[f"{name}/{what} losses"] = np.array([t.step()["loss"] for _ in range(3 if what == "lora" else 2)])
    return out


def parity(args):
    import numpy as np
    ref_file = Path(tempfile.mkdtemp()) / "cpu.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    names, full = chosen(args), not args.quick
    subprocess.run([sys.executable, __file__, "parity-child", str(ref_file), ",".join(names), str(int(full))], env=env, check=True)
    ref = dict(np.load(ref_file))
    import jax
    here, bf16 = parity_results(names, full=full), parity_results(names, "bfloat16")
    rows = []
    for name in names:
        a, b = ref[f"{name}/logits"], here[f"{name}/logits"]
        row = dict(row="parity", variant=name, backend=jax.default_backend(), logits_max_abs=float(np.abs(a - b).max()),
                   logits_scale=float(np.abs(a).max()),
                   greedy_equal=bool((ref[f"{name}/greedy"] == here[f"{name}/greedy"]).all()),
                   greedy_positions_equal=float((ref[f"{name}/greedy"] == here[f"{name}/greedy"]).mean()),
                   bf16_argmax_agreement=float((bf16[f"{name}/logits"].argmax(-1) == a.argmax(-1)).mean()))
        for what in ("lora", "full")[:2 if full else 1]:
            la, lb = ref[f"{name}/{what} losses"], here[f"{name}/{what} losses"]
            row[f"{what}_losses_cpu"], row[f"{what}_losses_here"] = la.round(6).tolist(), lb.round(6).tolist()
            row[f"{what}_losses_max_rel"] = float((np.abs(la - lb) / np.abs(la)).max())
        # a TPU's exp, tanh and rsqrt agree with a CPU's to 4-5 digits even at the highest matmul precision, and the
        # weights (std 0.2) amplify that through each block: logits within 1 % of their scale, the same greedy tokens
        row["ok"] = bool(row["logits_max_abs"] <= 1e-2 * max(1.0, row["logits_scale"]) and row["greedy_equal"]
                         and row["lora_losses_max_rel"] <= 1e-2 and row.get("full_losses_max_rel", 0) <= 1e-2)
        rows.append(row); emit(row, args.json)
    print(f"parity on {jax.default_backend()}: {sum(r['ok'] for r in rows)} of {len(rows)} variants agree with the CPU")


def peak_gib():
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30, stats.get("bytes_limit", 0) / 2**30


def row(args):
    import itertools, numpy as np, jax
    from meshtx import LM, Trainer, plan
    from meshtx.sharding import chip_of
    from common import read_bandwidth
    dev = jax.devices()[0]
    chip = chip_of(dev.device_kind)
    out = dict(row=args.mode, preset=args.preset, backend=jax.default_backend(), device=dev.device_kind, chip=chip)
    t0 = time.perf_counter()
    lm = LM.init(args.preset, dtype="bfloat16", tokenizer=None)
    jax.block_until_ready(lm.params)
    out.update(init_seconds=round(time.perf_counter() - t0, 1), n_params=lm.config.n_params, peak_after_init_gib=peak_gib()[0])
    cfg, rng = lm.config, np.random.default_rng(0)
    if args.mode == "infer":
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(lm.params))
        for B in dict.fromkeys((1, args.batch)):
            prompts = rng.integers(0, min(cfg.n_vocab, 50000), (B, args.prompt)).tolist()
            t0 = time.perf_counter()
            lm.generate(prompts, max_new_tokens=args.new, temperature=0, eos_token_id=None)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            lm.generate(prompts, max_new_tokens=args.new, temperature=0, eos_token_id=None)
            wall = time.perf_counter() - t0
            p = plan(cfg, 1, mode="infer", batch=B, seq=args.prompt + args.new, prompt=args.prompt, device=chip, param_dtype="bfloat16")
            out[f"batch{B}"] = dict(first_call_seconds=round(first, 2), seconds=round(wall, 3), tokens_per_s=round(B * args.new / wall, 2),
                                    plan_gib=p.total / 2**30, peak_gib=peak_gib()[0])
            print(f"  batch {B}: {out[f'batch{B}']}", file=sys.stderr, flush=True)   # what a time limit leaves
        # after: its 1 GiB must not sit beside the model (64 MiB for a toy, which a CPU's smoke test runs: 1 GiB there takes 30 s)
        out["read_bandwidth_gbs"] = read_bandwidth(1 << 30 if weight_bytes >= 1 << 28 else 1 << 26) / 1e9
        for B in dict.fromkeys((1, args.batch)):   # batch-1 decoding reads every weight once per token: the fastest it can go
            out[f"batch{B}"]["limit_tokens_per_s"] = round(B * out["read_bandwidth_gbs"] * 1e9 / weight_bytes, 2)
    else:
        S = args.seq
        tokens = rng.integers(0, cfg.n_vocab, (1, 1, S + 1))
        kw = dict(lora=8) if args.mode == "lora" else dict(param_dtype="bfloat16", mu_dtype="bfloat16")
        t = Trainer(lm, itertools.repeat(tokens), lr=1e-4, progress=False, remat=True, **kw)
        t0 = time.perf_counter(); first = t.step(); first_s = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter(); m = t.step(); jax.block_until_ready(t.state); times.append(time.perf_counter() - t0)
        p = plan(cfg.replace(remat=True), 1, mode=args.mode, batch=1, seq=S, device=chip, param_dtype="bfloat16",
                 opt_dtype="bfloat16", lora_rank=8, remat=True)
        from common import limits
        from train import train_flops
        lim = limits()
        if args.mode == "train" and lim: out["mfu"] = round(train_flops(cfg, 1, S) / min(times) / lim[0], 3)
        out.update(seq=S, first_step_seconds=round(first_s, 2), step_seconds=round(min(times), 3), tokens_per_s=round(S / min(times), 1),
                   loss=float(m["loss"]), plan_gib=p.total / 2**30)
    out["peak_gib"], out["limit_gib"] = peak_gib()
    if "plan_gib" in out: out["peak_over_plan"] = round(out["peak_gib"] / out["plan_gib"], 3)
    emit(out, args.json)


def plan_rows(args):
    "`meshtx.plan` against XLA's memory analysis of the compiled programs (abstract: nothing is allocated)."
    import jax
    import meshtx
    from memory import step_memory
    from meshtx.sharding import chip_of
    chip = chip_of(jax.devices()[0].device_kind)
    for name in args.presets:
        cfg = meshtx.ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
        for mode, lora, kw in (("lora", 8, dict(lora_rank=8)), ("train", 0, dict(opt_dtype="bfloat16"))):
            pl = meshtx.plan(cfg, 1, mode=mode, batch=args.batch, seq=args.seq, device=chip, param_dtype="bfloat16", remat=True, **kw)
            row = dict(row="plan", preset=name, mode=mode, batch=args.batch, seq=args.seq, plan_gib=pl.total / 2**30,
                       plan_parts_gib={k: round(v / 2**30, 3) for k, v in pl.bytes.items() if v}, plan_fits=pl.fits(chip) if chip else None)
            try:
                t0 = time.perf_counter()
                xla = step_memory(cfg, args.batch, args.seq, lora=lora)   # a full step's Adam moments in the weights' dtype (bf16)
                emit(dict(row, xla_gib=xla["total"] / 2**30, xla_arguments_gib=xla["arguments"] / 2**30,
                          xla_temporaries_gib=xla["temporaries"] / 2**30, plan_over_xla=round(pl.total / xla["total"], 3),
                          compile_seconds=round(time.perf_counter() - t0, 1)), args.json)
            except Exception as e:   # one preset's failure (say, a program too big for the chip) must not hide the rest
                emit(dict(row, error=f"{type(e).__name__}: {str(e)[:300]}"), args.json)


def prefill_memory(cfg, batch: int, prompt: int, slots: int, device=None) -> dict:
    """XLA's memory analysis (bytes) of `generate`'s prefill: a `prompt`-token batch into a donated `slots`-slot cache,
    the last position's logits (`meshtx.compiled.compiled_memory`; nothing allocated), on JAX's default device or on
    `device` (a deviceless one, bench/gpu_plan.py)."""
    from meshtx.compiled import compiled_memory
    c = compiled_memory(cfg, 1, "infer", batch, slots, prompt=prompt, param_dtype=cfg.param_dtype,
                        compute_dtype=cfg.compute_dtype, devices=None if device is None else [device])
    return dict(arguments=c.arguments, temporaries=c.temporaries, total=c.total)


def infer_plan_rows(args):
    "`plan(prompt=...)` against XLA's analysis of `generate`'s prefill, per preset and (batch, prompt, cache slots)."
    import jax
    import meshtx
    from meshtx.sharding import chip_of
    chip = chip_of(jax.devices()[0].device_kind)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    for name in args.presets:
        cfg = meshtx.ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16")
        for B, P, S in shapes:
            pl = meshtx.plan(cfg, 1, mode="infer", batch=B, seq=S, prompt=P, device=chip, param_dtype="bfloat16",
                             backend=None if chip else jax.default_backend())
            row = dict(row="infer_plan", preset=name, batch=B, prompt=P, slots=S, plan_gib=pl.total / 2**30,
                       plan_parts_gib={k: round(v / 2**30, 3) for k, v in pl.bytes.items() if v})
            try:
                t0 = time.perf_counter()
                xla = prefill_memory(cfg, B, P, S)
                emit(dict(row, xla_gib=xla["total"] / 2**30, xla_arguments_gib=xla["arguments"] / 2**30,
                          xla_temporaries_gib=xla["temporaries"] / 2**30, plan_over_xla=round(pl.total / xla["total"], 3),
                          compile_seconds=round(time.perf_counter() - t0, 1)), args.json)
            except Exception as e:   # a program too big for the chip must not hide the rest
                emit(dict(row, error=f"{type(e).__name__}: {str(e)[:300]}"), args.json)


def loss_program(cfg, batch: int, seq: int, head: bool) -> dict:
    """XLA's memory analysis of the fused loss alone, forward and backward, on `[batch, seq]` final hidden states:
    the gradient for the hidden states, and with `head` for the head's matrix too (a full step's; LoRA's head is frozen)."""
    import jax, jax.numpy as jnp
    from meshtx.model import fused_cross_entropy, LOSS_ROWS
    dt = jnp.dtype(cfg.compute_dtype)
    h, w = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), dt), jax.ShapeDtypeStruct((cfg.n_vocab, cfg.d_model), dt)
    t, b = jax.ShapeDtypeStruct((batch, seq), jnp.int32), jax.ShapeDtypeStruct((cfg.n_vocab,), jnp.float32)
    weights = jnp.full((batch, seq), 1.0 / (batch * seq), jnp.float32)
    f = lambda h, w, b, t: fused_cross_entropy(h, w, b, t, weights, rows=LOSS_ROWS)
    m = jax.jit(jax.grad(f, argnums=(0, 1) if head else 0)).lower(h, w, b, t).compile().memory_analysis()
    return dict(arguments=m.argument_size_in_bytes, temporaries=m.temp_size_in_bytes, output=m.output_size_in_bytes)


def loss_rows(args):
    """Where the loss's bytes go on this backend: the whole step (`--layers` blocks) at the full vocabulary and at half
    of it (the difference is the vocabulary's share: loss chunks, head, embedding), beside the plan's, and the loss
    program alone, in units of one chunk's float32 logits (`plan` counts 2 for LoRA, 3 + the head's gradient for a full step)."""
    import jax
    import meshtx
    from memory import step_memory
    from meshtx.model import LOSS_ROWS, n_loss_chunks
    from meshtx.sharding import chip_of
    chip, backend = chip_of(jax.devices()[0].device_kind), jax.default_backend()
    G = 2**30
    for name in args.presets:
        base = meshtx.ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
        if args.layers: base = base.replace(n_layer=args.layers)
        for mode, lora, kw in (("lora", 8, dict(lora_rank=8)), ("train", 0, dict(opt_dtype="bfloat16"))):
            row = dict(row="loss", preset=name, mode=mode, seq=args.seq, n_layer=base.n_layer, backend=backend)
            try:
                for tag, V in (("full", base.n_vocab), ("half", base.n_vocab // 2)):
                    cfg = base.replace(n_vocab=V)
                    pl = meshtx.plan(cfg, 1, mode=mode, batch=1, seq=args.seq, device=chip, backend=None if chip else backend,
                                     param_dtype="bfloat16", remat=True, **kw)
                    x = step_memory(cfg, 1, args.seq, lora=lora)
                    row[tag] = dict(plan_gib=round(pl.total / G, 4), xla_gib=round(x["total"] / G, 4),
                                    xla_temporaries_gib=round(x["temporaries"] / G, 4),
                                    plan_activations_gib=round(pl.bytes["activations"] / G, 4))
                    row[tag]["plan_over_xla"] = round(pl.total / x["total"], 3)
                row["vocab_share_plan_over_xla"] = round((row["full"]["plan_gib"] - row["half"]["plan_gib"])
                                                         / (row["full"]["xla_gib"] - row["half"]["xla_gib"]), 3)
                chunk = args.seq // n_loss_chunks(1, args.seq, LOSS_ROWS) * base.n_vocab * 4
                lp = loss_program(base, 1, args.seq, mode == "train")
                row["loss_program_temporaries_in_chunks"] = round(lp["temporaries"] / chunk, 3)
                row["chunk_gib"] = round(chunk / G, 4)
            except Exception as e:   # a program too big for the chip must not hide the rest
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(row, args.json)


def emit(row: dict, path=None):
    line = json.dumps(row, default=float)
    print(line, flush=True)
    if path:
        with open(path, "a") as f: f.write(line + "\n")


def main(argv=None):
    "One command (`sys.argv` by default; the tests run several in one process)."
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("parity"); a.add_argument("--json")
    a.add_argument("--quick", action="store_true", help="five variants, no full fine-tune step (compiling is slow on a TPU)")
    a.add_argument("--variants", help="comma-separated variant names (default: all, or --quick's five)")
    a = sub.add_parser("row"); a.add_argument("preset"); a.add_argument("mode", choices=["infer", "lora", "train"])
    a.add_argument("--seq", type=int, default=2048); a.add_argument("--batch", type=int, default=16)
    a.add_argument("--new", type=int, default=256); a.add_argument("--prompt", type=int, default=128); a.add_argument("--json")
    a = sub.add_parser("plan"); a.add_argument("presets", nargs="+"); a.add_argument("--seq", type=int, default=2048); a.add_argument("--json")
    a.add_argument("--batch", type=int, default=1)
    a = sub.add_parser("infer-plan", help="plan(prompt=) against XLA's analysis of generate's prefill")
    a.add_argument("presets", nargs="+"); a.add_argument("--json")
    a.add_argument("--shapes", default="1x128x384,8x128x384,1x1792x2048", help="batch x prompt x cache slots, comma-separated")
    a = sub.add_parser("loss", help="the training loss's share of the step: XLA against the plan")
    a.add_argument("presets", nargs="+"); a.add_argument("--seq", type=int, default=2048); a.add_argument("--json")
    a.add_argument("--layers", type=int, default=2, help="blocks in the step (0: the preset's); the loss does not depend on them")
    args = p.parse_args(argv)
    {"parity": parity, "row": row, "plan": plan_rows, "infer-plan": infer_plan_rows, "loss": loss_rows}[args.cmd](args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["parity-child"]:
        import numpy as np
        np.savez(sys.argv[2], **parity_results(sys.argv[3].split(","), full=sys.argv[4] == "1")); sys.exit()
    main()
