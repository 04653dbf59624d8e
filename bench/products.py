"""One matrix product at a time, meshtx's against torch's (HF's `nn.Linear`), in the same process, one side's calls after the other's.

A prefill of GPT-J-6B spends nearly all its time in the blocks' and the head's products (512 rows each at 1 × 512).
This times each product alone, as meshtx computes it (`meshtx.model.times_wt`: bf16 inputs, float32 accumulation,
under `jit`) and as HF's `GPTJForCausalLM` does (`torch.nn.functional.linear` in bf16), so a gap between the two
forwards can be put on the products or on everything else.

    python bench/products.py                  # GPT-J-6B's products at 512 rows, bf16
    python bench/products.py --rows 1,16,512 --repeats 30 --products out,lm_head
    python bench/products.py --rows 2,16 --forms   # then meshtx's two forms on a CPU: weights-first and x @ wᵀ

Prints, per product and row count, the median milliseconds of each side over `--repeats` alternated calls, and
GFLOP/s (2 · rows · n_in · n_out per call)."""
import argparse, json, os, statistics, time
import numpy as np

SHAPES = {"qkv": (3 * 4096, 4096), "out": (4096, 4096), "fc_in": (16384, 4096), "fc_out": (4096, 16384),
          "lm_head": (50400, 4096)}   # [n_out, n_in], as GPT-J-6B stores them


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="512"); ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--products", default=",".join(SHAPES), help=f"which of {', '.join(SHAPES)}")
    ap.add_argument("--json", default=None)
    ap.add_argument("--forms", action="store_true", help="also time meshtx's two forms for a few rows on a CPU, "
                    "weights-first (w @ xᵀ) and x @ wᵀ (as MESHTX_CPU_WEIGHTS_FIRST=1 and 0 choose)")
    a = ap.parse_args(argv)
    import jax, jax.numpy as jnp, torch
    from meshtx.model import times_wt
    torch.set_num_threads(os.cpu_count() or 1)   # as bench/scale.py runs HF (torch would take one thread per physical core)
    rng = np.random.default_rng(0)
    print(f"| product | rows | meshtx ms | torch ms | meshtx GFLOP/s | torch GFLOP/s | torch ÷ meshtx time |\n|---|---|---|---|---|---|---|")
    for name in a.products.split(","):
        n_out, n_in = SHAPES[name]
        w32 = rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02
        wj = jnp.asarray(w32, jnp.bfloat16); wt = torch.from_numpy(w32).to(torch.bfloat16); del w32
        for rows in (int(r) for r in a.rows.split(",")):
            x32 = rng.standard_normal((1, rows, n_in), dtype=np.float32)
            xj, xt = jnp.asarray(x32, jnp.bfloat16), torch.from_numpy(x32).to(torch.bfloat16)
            f = jax.jit(lambda x, w: times_wt(x, w).astype(jnp.bfloat16))
            f(xj, wj).block_until_ready()
            with torch.inference_mode(): torch.nn.functional.linear(xt, wt)
            tj, tt = [], []
            for _ in range(a.repeats):   # one side's calls, then the other's: each runtime's idle threads spin for
                t0 = time.perf_counter(); f(xj, wj).block_until_ready(); tj.append(time.perf_counter() - t0)
            time.sleep(0.5)               # a while after a call, and on 2 cores would take the other side's CPU
            with torch.inference_mode():
                torch.nn.functional.linear(xt, wt)
                for _ in range(a.repeats):
                    t0 = time.perf_counter(); torch.nn.functional.linear(xt, wt); tt.append(time.perf_counter() - t0)
            time.sleep(0.5)
            mj, mt = statistics.median(tj), statistics.median(tt)
            flop = 2 * rows * n_in * n_out
            print(f"| `{name}` [{n_out}, {n_in}] | {rows} | {1e3 * mj:.2f} | {1e3 * mt:.2f} | {flop / mj / 1e9:.0f} | "
                  f"{flop / mt / 1e9:.0f} | {mt / mj:.2f} |", flush=True)
            if a.json:
                with open(a.json, "a") as fh:
                    fh.write(json.dumps(dict(product=name, n_out=n_out, n_in=n_in, rows=rows, meshtx_ms=1e3 * mj,
                                             torch_ms=1e3 * mt, jax=jax.__version__, torch=torch.__version__)) + "\n")


    if a.forms: forms(a, rng)


def forms(a, rng):
    """meshtx's product of a few rows in each of a CPU's two forms, told by `MESHTX_CPU_WEIGHTS_FIRST` (the choice
    `cpu_weights_first` otherwise makes by timing, once per process): median ms and GB/s of weights read."""
    import jax, jax.numpy as jnp
    from meshtx.model import times_wt, cpu_weights_first
    print(f"\n`cpu_weights_first()` (timed) on this machine: {cpu_weights_first()}")
    print("| product | rows | weights-first ms | x @ wᵀ ms | weights-first GB/s | x @ wᵀ GB/s |\n|---|---|---|---|---|---|")
    told = os.environ.get("MESHTX_CPU_WEIGHTS_FIRST")
    try:
        for name in a.products.split(","):
            n_out, n_in = SHAPES[name]
            w = jnp.asarray(rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02, jnp.bfloat16)
            for rows in (int(r) for r in a.rows.split(",")):
                x, ms = jnp.asarray(rng.standard_normal((1, rows, n_in), dtype=np.float32), jnp.bfloat16), []
                for setting in ("1", "0"):
                    os.environ["MESHTX_CPU_WEIGHTS_FIRST"] = setting; cpu_weights_first.cache_clear()
                    f = jax.jit(lambda x, w: times_wt(x, w).astype(jnp.bfloat16))   # a new function: traced anew
                    f(x, w).block_until_ready(); ts = []
                    for _ in range(a.repeats):
                        t0 = time.perf_counter(); f(x, w).block_until_ready(); ts.append(time.perf_counter() - t0)
                    ms.append(1e3 * statistics.median(ts))
                gb = n_out * n_in * 2 / 1e9
                print(f"| `{name}` [{n_out}, {n_in}] | {rows} | {ms[0]:.2f} | {ms[1]:.2f} | {gb / ms[0] * 1e3:.1f} | {gb / ms[1] * 1e3:.1f} |", flush=True)
    finally:
        os.environ.pop("MESHTX_CPU_WEIGHTS_FIRST", None)
        if told is not None: os.environ["MESHTX_CPU_WEIGHTS_FIRST"] = told
        cpu_weights_first.cache_clear()


if __name__ == "__main__":
    main()
