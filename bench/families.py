"""Another family at its real size on this machine: meshtx against HF transformers, each in its own process.

    python bench/families.py llama-3.2-1b [--layers N] [--new 16] [--dtype bfloat16|float32] [--workdir DIR]

Writes (once, cached under `--workdir`) a random bfloat16 checkpoint of the preset's shape in Hugging Face's layout
(sharded safetensors, the names `meshtx.families` maps, the family's own `config.json`), tensor by tensor from a
seeded generator, without building a model. Then runs, strictly one process at a time, HF's side first:

| row | work |
|---|---|
| load | `LM.from_hf` (bf16) / `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`: wall seconds, peak RSS |
| logits | the 32-token prompt's logits: argmax agreement, max |Δ| (both bf16) |
| generate | greedy, batch 1, a 32-token prompt, `--new` tokens: are the tokens HF's? (HF's top-2 gap where they part) |
| decode1 | batch-1 decode tokens/s after the first token: (t(new) − t(1)) / (new − 1), fastest of `--repeats` |

Each child reports its own peak RSS (VmHWM) and timings as one JSON line; the parent prints one table and appends the
rows to `--json` if given. Weights are drawn N(0, 0.02) (norms near 1): random models have near-ties between their top
two tokens, where bf16 rounding may pick either, so a divergence is reported with HF's top-2 gap at that position."""
from __future__ import annotations
import argparse, json, os, subprocess, sys, time, zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "@@families-result "
SEED, PROMPT_SEED = 1234, 7


def peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"): return int(line.split()[1]) * 1024
    return 0


def config(a):
    from meshtx import ModelConfig
    c = ModelConfig.preset(a.preset)
    return c.replace(n_layer=a.layers) if a.layers else c


def child_write(a):
    "The checkpoint, shard by shard (at most 2 GB each), tensor by tensor, in bf16."
    import numpy as np, ml_dtypes
    from safetensors.numpy import save_file
    from meshtx.weights import hf_shapes
    c = config(a)
    dest = Path(a.ckpt); tmp = dest.with_name(dest.name + ".tmp"); tmp.mkdir(parents=True, exist_ok=True)
    groups, size = [[]], 0
    for name, shape in hf_shapes(c).items():
        n = 2 * int(np.prod(shape))
        if groups[-1] and size + n > 2e9: groups.append([]); size = 0
        groups[-1].append((name, shape)); size += n
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for k, group in enumerate(groups, 1):
        fn = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
            x = rng.standard_normal(shape, dtype=np.float32)
            if len(shape) == 1: x = (1.0 + 0.05 * x) if "norm" in name else 0.01 * x
            else: x *= 0.02
            tensors[name] = x.astype(ml_dtypes.bfloat16); del x
            weight_map[name] = fn; total += tensors[name].nbytes
        save_file(tensors, str(tmp / fn), metadata={"format": "pt"}); del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    hf = c.to_hf(); hf.to_json_file(str(tmp / "config.json"))
    tmp.rename(dest)
    return {"seconds": time.perf_counter() - t0, "bytes": total, "shards": len(groups)}


def prompt(a):
    import numpy as np
    return np.random.default_rng(PROMPT_SEED).integers(0, min(config(a).n_vocab, 32000), (1, 32))


def child_hf(a):
    import numpy as np, torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=getattr(torch, a.dtype)).eval()
    out = {"load": time.perf_counter() - t0, "load_peak": peak()}
    x = torch.tensor(prompt(a))
    def run(n):
        with torch.inference_mode():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    g = run(a.new)
    tokens = g.sequences[0, x.shape[1]:].tolist()
    top2 = [torch.topk(l[0].float(), 2).values for l in g.logits]
    with torch.inference_mode(): logits = model(x).logits[0].float().numpy()   # the prompt's, [32, V]
    np.savez(Path(a.workdir) / "hf_generate.npz", tokens=tokens, gaps=[float(t[0] - t[1]) for t in top2], logits=logits)
    out["decode1"] = _rate(run, a)
    out["peak"] = peak()
    return out


def _rate(run, a) -> float:
    "Batch-1 decode tokens/s, the prompt's prefill and the first token excluded: the fastest of `--repeats`."
    best = []
    for n in (1, a.new):
        run(n); ts = []
        for _ in range(a.repeats):
            t0 = time.perf_counter(); run(n); ts.append(time.perf_counter() - t0)
        best.append(min(ts))
    return (a.new - 1) / (best[1] - best[0])


def child_meshtx(a):
    import numpy as np, jax
    from meshtx import LM
    t0 = time.perf_counter()
    lm = LM.from_hf(a.ckpt, dtype=a.dtype, progress=False, tokenizer=None)
    jax.block_until_ready(lm.params)
    out = {"load": time.perf_counter() - t0, "load_peak": peak()}
    ids = prompt(a).tolist()
    run = lambda n: lm.generate(ids, max_new_tokens=n, temperature=0, eos_token_id=None)
    tokens = run(a.new).tokens[0]
    ref = np.load(Path(a.workdir) / "hf_generate.npz")
    hf_t, gaps = ref["tokens"].tolist(), ref["gaps"]
    sure = next((i for i, g in enumerate(gaps) if g <= 0.1), len(gaps))   # positions where HF's choice is clear
    diff = next((i for i in range(min(len(tokens), len(hf_t))) if tokens[i] != hf_t[i]), None)
    out.update(tokens_equal=tokens == hf_t, first_diff=diff, clear_positions=sure,
               equal_where_clear=tokens[:sure] == hf_t[:sure], gap_at_diff=None if diff is None else float(gaps[diff]))
    got, want = np.asarray(lm.logits(prompt(a)))[0], ref["logits"]   # bf16: within bf16 noise; float32: ~1e-4
    out.update(logits_max_diff=float(np.abs(got - want).max()), logits_scale=float(np.abs(want).max()),
               argmax_agree=float((got.argmax(-1) == want.argmax(-1)).mean()))
    out["decode1"] = _rate(run, a)
    out["peak"] = peak()
    return out


def child(a):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res = {"write": child_write, "hf": child_hf, "meshtx": child_meshtx}[a.child](a)
    print(MARK + json.dumps(res), flush=True)


def spawn(a, which: str) -> dict:
    cmd = [sys.executable, __file__, a.preset, "--child", which, "--ckpt", a.ckpt, "--workdir", a.workdir,
           "--new", str(a.new), "--repeats", str(a.repeats), "--dtype", a.dtype] + (["--layers", str(a.layers)] if a.layers else [])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    line = next((l for l in p.stdout.splitlines() if l.startswith(MARK)), None)
    if line is None: return {"error": (p.stderr or p.stdout)[-1500:], "wall": time.perf_counter() - t0}
    return {**json.loads(line[len(MARK):]), "wall": time.perf_counter() - t0}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("preset"); p.add_argument("--layers", type=int, default=0)
    p.add_argument("--new", type=int, default=16); p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both sides compute in it")
    p.add_argument("--workdir", default=str(Path.home() / ".cache/meshtx/bench-families"))
    p.add_argument("--ckpt", default=None); p.add_argument("--child", default=None)
    p.add_argument("--timeout", type=int, default=3600); p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.child: return child(a)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    a.ckpt = a.ckpt or str(Path(a.workdir) / f"{a.preset}-L{a.layers or 'all'}-bf16")
    rows = {}
    if not Path(a.ckpt).exists(): rows["write"] = spawn(a, "write")
    rows["hf"] = spawn(a, "hf")
    rows["meshtx"] = spawn(a, "meshtx")
    import platform
    print(json.dumps({"preset": a.preset, "layers": a.layers or "all", "dtype": a.dtype, "new": a.new, "cpus": os.cpu_count(),
                      "machine": platform.machine(), **rows}, indent=1))
    h, m = rows["hf"], rows["meshtx"]
    if "error" not in h and "error" not in m:
        print(f"| {a.preset} | load {m['load']:.1f} s vs HF {h['load']:.1f} s | load peak {m['load_peak'] / 1e9:.1f} vs "
              f"{h['load_peak'] / 1e9:.1f} GB | decode1 {m['decode1']:.2f} vs {h['decode1']:.2f} tok/s "
              f"({m['decode1'] / h['decode1']:.2f}×) | peak {m['peak'] / 1e9:.1f} vs {h['peak'] / 1e9:.1f} GB | "
              f"tokens equal {m['tokens_equal']} (first diff {m['first_diff']}, HF's top-2 gap there {m['gap_at_diff']}) | "
              f"prompt logits: argmax {m['argmax_agree']:.0%} equal, max |Δ| {m['logits_max_diff']:.3f} of {m['logits_scale']:.2f} |")
    if a.json:
        with open(a.json, "a") as f: f.write(json.dumps({"preset": a.preset, "layers": a.layers, **rows}) + "\n")


if __name__ == "__main__":
    main()
