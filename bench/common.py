"""Shared pieces of the benchmarks: configs, the same weights in meshtx and HF transformers, timing, the table.

Every benchmark runs meshtx AND Hugging Face transformers (PyTorch) on the same config and the same weights in
the same process, and prints one table: figure, meshtx, HF, ratio (meshtx / HF, higher is better), and on a GPU
or TPU the fraction of the hardware limit (memory bandwidth for decode, peak bf16 FLOP/s for training)."""
from __future__ import annotations
import argparse, json, os, platform, statistics, subprocess, sys, tempfile, time
from pathlib import Path

# JAX and PyTorch share the accelerator in every benchmark: JAX must not grab 75 % of its memory up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from meshtx.config import PRESETS   # the model shapes, by the names meshtx uses everywhere: tiny for CI smoke runs,
                                    # small for CPU ratios (8 blocks of 512), gptj-6b on an accelerator
# peak dense bf16 FLOP/s and HBM bandwidth (bytes/s) from the vendors' data sheets, by jax device_kind prefix
CHIP_LIMITS = {"NVIDIA H200": (989e12, 4.8e12), "NVIDIA H100": (989e12, 3.35e12), "NVIDIA A100": (312e12, 2.0e12),
               "TPU v5 lite": (197e12, 0.819e12), "TPU v5e": (197e12, 0.819e12), "TPU v4": (275e12, 1.2e12),
               "TPU v3": (123e12, 0.9e12), "TPU v2": (45e12, 0.6e12)}


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model shape (default small)")
    p.add_argument("--dtype", help="parameter/compute dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (the median is reported)")
    p.add_argument("--json", help="append the rows as JSON lines to this file")
    p.add_argument("--no-hf", action="store_true", help="meshtx only")
    p.add_argument("--attention", default="xla", choices=["xla", "cudnn"], help="meshtx full-sequence attention")
    p.add_argument("--remat-policy", default="nothing", choices=["nothing", "dots"], help="with --checkpointing")
    return p


def backend() -> str:
    import jax
    return jax.default_backend()


def default_dtype(args) -> str:
    return args.dtype or ("float32" if backend() == "cpu" else "bfloat16")


def limits():
    "(peak FLOP/s, bandwidth) of this chip, or None on CPU / unknown chips."
    import jax
    kind = jax.devices()[0].device_kind
    return next((v for k, v in CHIP_LIMITS.items() if kind.startswith(k)), None)


def read_bandwidth(nbytes: int, reads: int = 8) -> float:
    """Bytes per second this device reads, measured two ways over `nbytes`: a sum of a float32 array, and a bfloat16
    matrix times a vector (batch-1 decoding's own operation, which reads every weight once per token), each once and
    `reads` times in one program (so that launching it does not count). The faster of the two, each the fastest of 9 runs, is
    the limit decoding can at best reach here (next to the data sheet's figure in `CHIP_LIMITS`): a limit is what the
    device can do, and a busy neighbour on a shared machine only slows a read (a median here once gave half the rate
    the decode itself then reached). One read of 1 GiB per program on a TPU v5e measured 512-536 GB/s while GPT-J-6B's
    batch-1 decode ran at 58 tok/s, about 700 GB/s of weights."""
    import jax, jax.numpy as jnp
    def fastest(x, read_once):
        rates = []
        for n in dict.fromkeys((1, reads)):   # one read per program too: XLA:CPU runs the loop's reads slower (21 GB/s, not 31)
            f = jax.jit(lambda x, n=n: jax.lax.fori_loop(0, n, lambda i, acc: acc + read_once(x, acc), jnp.zeros((), jnp.float32)))
            run = lambda: f(x).block_until_ready()   # each read depends on the last: XLA can neither hoist nor merge them
            rates.append(n * x.nbytes / min(timed(run, repeats=1, warmup=2 if i == 0 else 0) for i in range(9)))
        return max(rates)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    summed = fastest(x, lambda x, acc: (x + acc).sum())
    del x
    w = jnp.ones((nbytes // 2 // 4096, 4096), jnp.bfloat16)
    return max(summed, fastest(w, lambda w, acc: (w @ jnp.full((4096,), acc, w.dtype)).sum(dtype=jnp.float32)))


def config(args):
    from meshtx import ModelConfig
    return ModelConfig(**PRESETS[args.preset], attention=args.attention, remat_policy=args.remat_policy)


def torch_device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def models(cfg, dtype: str, hf: bool = True, seed: int = 0):
    """`(lm, hf_model)` holding the same random weights: meshtx initialises them, and HF's model, built on its
    device, gets a copy tensor by tensor (no checkpoint on disk: 12 GB at the 6B shape). The two models'
    logits are compared before anything is timed."""
    import numpy as np
    from meshtx import LM
    lm = LM.init(cfg, seed=seed, dtype=dtype, tokenizer=None)
    if not hf: return lm, None
    import torch, transformers
    from meshtx.weights import hf_tensors
    transformers.logging.set_verbosity_error()
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(torch_device()): model = transformers.GPTJForCausalLM(cfg.to_hf())
    finally: torch.set_default_dtype(default)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in hf_tensors(lm.params, cfg):
            t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" else torch.from_numpy(a)
            own.pop(name).copy_(t)
    if own: raise RuntimeError(f"HF parameters without a meshtx counterpart: {sorted(own)}")
    model.eval()
    check_parity(lm, model, cfg, dtype)
    return lm, model


def check_parity(lm, model, cfg, dtype):
    "Stop if meshtx and HF disagree on the logits of a short random sequence (float32 tolerance, looser in bf16)."
    import numpy as np, torch
    ids = np.random.default_rng(0).integers(0, cfg.n_vocab, (1, 16))
    ours = np.asarray(lm.logits(ids), np.float32)
    with torch.no_grad(): theirs = model(torch.tensor(ids, device=torch_device())).logits.float().cpu().numpy()
    err, tol = float(np.abs(ours - theirs).max()), (1e-3 if dtype == "float32" else 0.25)
    print(f"(parity: max |logit difference| meshtx vs HF = {err:.2e})")
    if not err <= tol: raise RuntimeError(f"meshtx and HF logits differ by {err} (> {tol}): not the same model")


def timed(fn, repeats: int = 3, warmup: int = 1) -> float:
    "Median wall-clock seconds of `fn()` (which must block until its work is done) after `warmup` calls."
    for _ in range(warmup): fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return statistics.median(times)


def top_ops(fn, n: int = 15) -> dict:
    """Run `fn` (once to warm up, then) once under `jax.profiler`: its `n` costliest ops as (name, total ms, count),
    the wall-clock ms of the traced call and, on a GPU or TPU, the ms the device was busy (the sum of its kernels).
    On a GPU or TPU only the device's lanes count (kernels); on a CPU, XLA's thunks, whose spans overlap (no busy
    figure). Busy far below wall means the device waits: on the host, launches or synchronisations."""
    import collections, glob, gzip, jax
    fn()   # compiled and warm before the trace
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        try:
            t0 = time.perf_counter(); fn(); wall = 1e3 * (time.perf_counter() - t0)
        finally: jax.profiler.stop_trace()
        events = json.load(gzip.open(sorted(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True))[-1]))["traceEvents"]
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:" in name}
    host_only = ("$", "ThunkExecutor", "np.asarray", "PjitFunction", "SlinkyThreadPool")
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or not e.get("dur") or (device and e["pid"] not in device) or e["name"].startswith(host_only):
            continue
        total[e["name"]] += e["dur"] / 1e3
        count[e["name"]] += 1
    return dict(ops=[(name, ms, count[name]) for name, ms in total.most_common(n)], wall_ms=wall,
                busy_ms=sum(total.values()) if device else None)


def print_top_ops(title: str, trace: dict):
    print(f"\n{title}\n| op | total ms | count |\n|---|---|---|")
    for name, ms, k in trace["ops"]: print(f"| `{name[:90]}` | {ms:,.1f} | {k} |")
    busy = trace["busy_ms"]
    print(f"(traced call: {trace['wall_ms']:,.1f} ms wall" +
          (f"; device busy {busy:,.1f} ms = {busy / trace['wall_ms']:.0%})" if busy is not None else ")"))


def sync_torch():
    import torch
    if torch.cuda.is_available(): torch.cuda.synchronize()


def commit() -> str:
    try: return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError: return "unknown"


def environment() -> dict:
    import jax
    from importlib.metadata import version
    env = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "n_devices": jax.device_count()}
    for pkg in ("jax", "jaxlib", "dm-haiku", "torch", "transformers", "peft"):
        try: env[pkg] = version(pkg)
        except Exception: env[pkg] = "-"
    return env


def report(title: str, rows: list[dict], args, notes: str = ""):
    """Print the table (and append JSON lines if asked). A row: figure, meshtx, hf, unit, and optionally limit
    (the fraction of the hardware limit meshtx reaches)."""
    print(f"\n### {title} — preset {args.preset}, {default_dtype(args)}, {backend()}")
    print("| figure | meshtx | HF transformers | ratio | of hardware limit |")
    print("|---|---|---|---|---|")
    for r in rows:
        m, h = r.get("meshtx"), r.get("hf")
        fmt = lambda v: "—" if v is None else f"{v:,.4g} {r['unit']}"
        ratio = f"{m / h:.2f}×" if m and h else "—"
        if r.get("lower_is_better") and m and h: ratio = f"{h / m:.2f}×"
        lim = f"{r['limit']:.0%}" if r.get("limit") is not None else "—"
        print(f"| {r['figure']} | {fmt(m)} | {fmt(h)} | {ratio} | {lim} |")
    if notes: print(notes)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows: f.write(json.dumps({"bench": title, "preset": args.preset, "dtype": default_dtype(args), **r}) + "\n")
    sys.stdout.flush()
