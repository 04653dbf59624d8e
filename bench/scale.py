"""GPT-J-6B at its real width on this machine: meshtx against HF transformers, each in its own process.

Writes (once, cached) a random GPT-J-6B-shape checkpoint in Hugging Face's layout, float16, sharded safetensors,
without building a model (tensor by tensor from a seeded numpy generator), and a copy as a sharded float16
`pytorch_model.bin` (the form the hub publishes GPT-J-6B in). Then runs each row below in a child process, strictly
one at a time (HF's side too), and prints one table:

| row | work | target |
|---|---|---|
| load | `LM.from_hf` of the sharded safetensors (HF: `from_pretrained`, bf16) | wall ≤ HF's; peak ≤ weights + 1 GB |
| convert | `meshtx convert` HF → meshtx → HF (HF: load + `save_pretrained`) | ≤ 2× HF's; peak ≤ weights + one shard; bit-exact |
| logits | `lm.logits` of 1 × 128 tokens | peak ≤ weights + 2 GB; argmax equals HF's at ≥ 95 % of positions |
| generate | `lm.generate`, batch 1, 32-token prompt, 32 new tokens, greedy | peak ≤ weights + 2 GB; tokens equal HF's wherever HF's top-2 gap > 0.1 |
| decode1 | batch-1 decode tokens/s | ≥ 1.25× HF's; ≥ 50 % of the limit that the measured read bandwidth sets |
| prefill | 1 × 512 forward, tokens/s | ≥ HF's |
| decode16 | batch-16 decode tokens/s | ≥ HF's |
| slots | continuous batching (`meshtx.slots`, the server's engine): 16 greedy requests of mixed lengths in 8 rows, against `generate` in FIFO batches of 8 (meshtx both sides) | throughput and mean latency ≥ / ≤ generate's; tokens equal generate's wherever its top-2 gap > 0.1; peak ≤ weights + cache + 2 GB |
| lora128, lora512 | one LoRA step (rank 8, batch 1, remat) at seq 128 / 512 | runs; measured peak within 10 % of `plan` |
| train | one full fine-tune step (f32 masters, AdamW, remat), as many layers as fit the budget | runs; peak within 10 % of `plan` |
| plan | `meshtx.plan` against XLA's compiled memory analysis, infer / LoRA / train | within 10 % |
| bin | `LM.from_hf` of the sharded float16 `pytorch_model.bin`, with torch made unimportable | loads; peak ≤ the safetensors load's + 10 % |

How things are measured:
- Every child reports its own peak RSS (`VmHWM` of /proc/self/status: this process image's high-water mark), its
  RSS after its imports ("baseline") and its timings as one JSON line; the parent also reaps each child with
  `os.wait4` (its `ru_maxrss`) and polls psutil (the child and its descendants) as cross-checks, and kills a child
  that runs past `--timeout` or whose own (anonymous) memory goes above `--max-rss` (reported as such, with the peak it
  reached; mapped file pages do not count there, since the kernel can drop them). RSS counts the pages of
  memory-mapped files a process has touched (a safetensors checkpoint read through mmap) as well as its own memory;
  the process table's "psutil anon" column is the polled peak of RSS less those file-backed pages.
- "weights" is the model's parameter count × 2 bytes (bf16 / fp16). GB are 10⁹ bytes.
- Speeds are the fastest of `--repeats` timed calls after a warm-up (compilation excluded): on a shared machine a
  neighbour only slows a call down (torch's two OpenMP threads by 5× when another process takes a core), and the
  fastest call is the most reproducible figure. The process table gives the 1-minute load average before and after
  each child, to judge how busy the machine was. Decode tokens/s count the tokens after the first:
  (t(N new) − t(1 new)) / (N − 1) per row, so the prompt's prefill is excluded too.
- The read bandwidth is `common.read_bandwidth` (the fastest of 9 sums over 1 GiB) in a child of its own, before the
  rows and again after the batch-1 decode; the better probe counts (a busy neighbour only slows a probe down). The
  limit counts every weight's bytes per token, as the target does; the note also gives the share counting only what a
  step reads (every weight but the embedding table: at 28 layers 0.97 of the weights, at 1 layer 0.67).
- Memory against `plan`: measured = peak RSS − baseline (the runtime's own memory is no part of a plan). The `plan`
  row compiles, abstractly, the forward of a 1 × 512 prompt into a 512-slot cache (infer), and one LoRA and one full
  training step (bench/memory.py's `step_memory`), in bfloat16 (the target) and in float32 (on a CPU, whose XLA has
  no bf16 matmuls and converts bf16 weights to float32 copies, the float32 plans are the meaningful ones).
- Each loading process (`load`, `bin`) starts from the same page-cache state (`same_start`: dropped where root may,
  then the checkpoint read once, so neither side pays the disk); `load` runs both sides twice, alternating, and the
  faster of each side's two counts.

`--layers N` runs the 6B width at N layers (default 28: 12.1 GB of weights; at 1 layer HF's `from_pretrained` peaked at
2.3 × the weights in RSS, half of it the checkpoint's mapped pages); `--d-model/--d-ff/--n-head/--vocab` shrink the
width (for smoke tests). Example: `python bench/scale.py --layers 2 --max-rss 6 --json results.jsonl`."""
from __future__ import annotations
import argparse, json, os, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "@@scale-result "
ROWS = ["load", "convert", "logits", "generate", "decode1", "prefill", "decode16", "slots", "lora128", "lora512", "train", "plan", "bin"]
GB = 1e9
FORMAT = 1   # the checkpoint's recipe; a cached checkpoint written by another recipe is written again
SEED = 1234
PROMPT_SEED = 7
LOAD_ROUNDS = 2


# ---------------------------------------------------------------------------------------------------------------------
# the model's shape (plain arithmetic: the parent imports neither numpy, JAX nor torch)

def shape(args) -> dict:
    d, h = args.d_model, args.n_head
    return dict(n_layer=args.layers, d_model=d, n_head=h, rotary_dim=min(64, d // h), d_ff=args.d_ff or 4 * d,
                n_vocab=args.vocab, n_ctx=2048)


def n_params(s: dict) -> int:
    D, F, V = s["d_model"], s["d_ff"], s["n_vocab"]
    block = 2 * D + 4 * D * D + (D * F + F) + (F * D + D)
    return V * D + s["n_layer"] * block + 2 * D + (D * V + V)


def tensor_specs(s: dict) -> list:
    "`[(name, shape, kind)]` of a Hugging Face GPTJForCausalLM, in its order; kind: weight, ln (near 1), bias."
    D, F, V = s["d_model"], s["d_ff"], s["n_vocab"]
    out = [("transformer.wte.weight", (V, D), "weight")]
    for i in range(s["n_layer"]):
        p = f"transformer.h.{i}."
        out += [(p + "ln_1.weight", (D,), "ln"), (p + "ln_1.bias", (D,), "bias")]
        out += [(p + f"attn.{n}_proj.weight", (D, D), "weight") for n in ("q", "k", "v", "out")]
        out += [(p + "mlp.fc_in.weight", (F, D), "weight"), (p + "mlp.fc_in.bias", (F,), "bias"),
                (p + "mlp.fc_out.weight", (D, F), "weight"), (p + "mlp.fc_out.bias", (D,), "bias")]
    out += [("transformer.ln_f.weight", (D,), "ln"), ("transformer.ln_f.bias", (D,), "bias"),
            ("lm_head.weight", (V, D), "weight"), ("lm_head.bias", (V,), "bias")]
    return out


def shard_limit(s: dict) -> int:
    "Largest shard in bytes: 2 GB (7 shards at 28 layers), or a third of the model when that is smaller (still sharded)."
    return int(min(2e9, 2 * n_params(s) / 3))


def shards(s: dict) -> list:
    "The tensors of each shard, in order (a shard closes before the tensor that would take it past `shard_limit`)."
    limit, out, size = shard_limit(s), [[]], 0
    for name, shp, kind in tensor_specs(s):
        nbytes = 2
        for n in shp: nbytes *= n
        if out[-1] and size + nbytes > limit: out.append([]); size = 0
        out[-1].append((name, shp, kind)); size += nbytes
    return out


def cache_name(s: dict, kind: str) -> str:
    six = (s["d_model"], s["d_ff"], s["n_head"], s["n_vocab"]) == (4096, 16384, 16, 50400)
    width = "gptj6b" if six else f"gptj-d{s['d_model']}-f{s['d_ff']}-h{s['n_head']}-v{s['n_vocab']}"
    return f"{width}-L{s['n_layer']}-fp16-{kind}"


def meta(s: dict) -> dict:
    return {"format": FORMAT, "seed": SEED, "shape": s, "shards": len(shards(s))}


def is_complete(d: Path, s: dict) -> bool:
    try: return json.loads((d / "scale.json").read_text()) == meta(s)
    except (OSError, ValueError): return False


# ---------------------------------------------------------------------------------------------------------------------
# children: each runs one piece of work and prints one JSON line (MARK + json) on stdout

def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"): return int(line.split()[1])
    return 0


def rss() -> int: return _status_kb("VmRSS") * 1024
def peak() -> int: return _status_kb("VmHWM") * 1024


def child_env():
    "Both cores for torch and XLA, offline, quiet, one JAX device."
    n = str(os.cpu_count() or 1)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"): os.environ[k] = n
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags)


def setup(side: str) -> dict:
    "Import the side's libraries and start its runtime; returns the baseline (RSS after that)."
    if side == "hf":
        import torch, transformers
        torch.set_num_threads(os.cpu_count() or 1)
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    else:
        import jax, jax.numpy as jnp
        import meshtx  # noqa: F401  (LM, LM.generate, Trainer, plan)
        jnp.zeros(1).block_until_ready()
    return {"baseline": rss()}


def cfg_meshtx(s: dict, **kw):
    from meshtx import ModelConfig
    return ModelConfig(**s, **kw)


def prompt_ids(s: dict, batch: int, n: int):
    import numpy as np
    return np.random.default_rng([PROMPT_SEED, batch, n]).integers(0, min(s["n_vocab"], 50257), (batch, n))


def timed(fn, repeats: int) -> float:
    "The fastest of `repeats` calls of `fn` after one warm-up call (a busy neighbour only ever slows a call down)."
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return min(ts)


def child_write(a, s):
    "Write the safetensors checkpoint into `a.dest` (a fresh directory), shard by shard, tensor by tensor."
    import zlib, numpy as np
    from safetensors.numpy import save_file
    from transformers import GPTJConfig
    dest = Path(a.dest); dest.mkdir(parents=True)
    plan_ = shards(s)
    n, weight_map, total = len(plan_), {}, 0
    t0 = time.perf_counter()
    for k, group in enumerate(plan_, 1):
        fn = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name, shp, kind in group:
            rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
            out = np.empty(shp, np.float16)
            flat = out.reshape(shp[0], -1)
            step = max(1, (16 << 20) // (flat.shape[1] * 4))   # 16 MB of float32 at a time
            for r in range(0, flat.shape[0], step):
                x = rng.standard_normal(flat[r:r + step].shape, dtype=np.float32)
                if kind == "weight": x *= 0.02
                elif kind == "ln": x *= 0.05; x += 1.0
                else: x *= 0.01
                flat[r:r + step] = x
            tensors[name] = out
            weight_map[name] = fn
            total += out.nbytes
        save_file(tensors, str(dest / fn), metadata={"format": "pt"})
        del tensors
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    eos = min(50256, s["n_vocab"] - 1)
    c = GPTJConfig(vocab_size=s["n_vocab"], n_positions=s["n_ctx"], n_embd=s["d_model"], n_layer=s["n_layer"],
                   n_head=s["n_head"], rotary_dim=s["rotary_dim"], n_inner=s["d_ff"], activation_function="gelu_new",
                   layer_norm_epsilon=1e-5, tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
                   architectures=["GPTJForCausalLM"])
    c.to_json_file(str(dest / "config.json"))
    d = json.loads((dest / "config.json").read_text())
    d["dtype"] = "float16"        # transformers 5's name (4.x: torch_dtype)
    (dest / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    if s["n_vocab"] >= 50257:
        from meshtx.tokenizer import gpt2_tokenizer
        gpt2_tokenizer().save_pretrained(str(dest))
    (dest / "scale.json").write_text(json.dumps(meta(s)))
    return {"seconds": time.perf_counter() - t0, "bytes": total, "shards": n}


def child_write_bin(a, s):
    "The same tensors as a sharded float16 `pytorch_model.bin` (one torch.save per shard)."
    import torch
    from safetensors import safe_open
    src, dest = Path(a.ckpt), Path(a.dest)
    dest.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = list(dict.fromkeys(index["weight_map"].values()))
    weight_map, t0 = {}, time.perf_counter()
    for k, fn in enumerate(files, 1):
        out = f"pytorch_model-{k:05d}-of-{len(files):05d}.bin"
        with safe_open(str(src / fn), framework="pt") as f:
            sd = {name: f.get_tensor(name) for name in f.keys()}
        torch.save(sd, str(dest / out))
        weight_map.update({name: out for name in sd})
        del sd
    (dest / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": index["metadata"], "weight_map": weight_map}, indent=2))
    for p in src.iterdir():
        if p.suffix == ".json" and p.name not in ("model.safetensors.index.json", "scale.json") or p.name in ("merges.txt", "vocab.json"):
            shutil.copy(p, dest / p.name)
    (dest / "scale.json").write_text(json.dumps(meta(s)))
    return {"seconds": time.perf_counter() - t0, "shards": len(files)}


def child_bandwidth(a, s):
    out = setup("meshtx")
    sys.path.insert(0, str(HERE))
    from common import read_bandwidth
    # 1 GiB (far beyond any cache), or 256 MiB for a model smaller than that (smoke tests)
    return {**out, "bandwidth": read_bandwidth(2**30 if 2 * n_params(s) >= 2**30 else 2**28)}


def load_hf(path, dtype="bfloat16"):
    import torch
    from transformers import GPTJForCausalLM
    t0 = time.perf_counter()
    model = GPTJForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    return model, time.perf_counter() - t0


def load_meshtx(path):
    import jax
    from meshtx import LM
    t0 = time.perf_counter()
    lm = LM.from_hf(str(path), progress=False)
    jax.block_until_ready(lm.params)
    return lm, time.perf_counter() - t0


def child_load(a, s):
    if a.no_torch: sys.modules["torch"] = None   # `import torch` raises ImportError; transformers sees no torch
    out = setup(a.side)
    if a.side == "hf":
        model, sec = load_hf(a.ckpt)
        dt = str(next(model.parameters()).dtype)
    else:
        lm, sec = load_meshtx(a.ckpt)
        dt = str(lm.params["gptj/wte"]["embedding"].dtype)
    out.update(seconds=sec, peak=peak(), dtype=dt)
    if a.no_torch: out["torch_imported"] = sys.modules.get("torch") is not None
    return out


def child_hf_convert(a, s):
    "HF's side of the convert row: load as stored (float16) and save_pretrained in shards of the same size."
    out = setup("hf")
    model, sec = load_hf(a.ckpt, "float16")
    t0 = time.perf_counter()
    model.save_pretrained(a.dest, max_shard_size=a.max_shard_size)
    out.update(load_seconds=sec, save_seconds=time.perf_counter() - t0, seconds=sec + time.perf_counter() - t0, peak=peak())
    return out


def child_roundtrip(a, s):
    "Compare two safetensors checkpoints tensor by tensor, bit for bit (one tensor in memory at a time per side)."
    import numpy as np
    from safetensors import safe_open
    def index(d):
        d = Path(d)
        if (d / "model.safetensors.index.json").exists():
            return {k: d / v for k, v in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].items()}
        with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
            return {k: d / "model.safetensors" for k in f.keys()}
    a_map, b_map = index(a.ckpt), index(a.dest)
    same, differ = 0, []
    missing, extra = sorted(set(a_map) - set(b_map)), sorted(set(b_map) - set(a_map))
    for name in a_map:
        if name not in b_map: continue
        with safe_open(str(a_map[name]), framework="numpy") as f: x = f.get_tensor(name)
        with safe_open(str(b_map[name]), framework="numpy") as f: y = f.get_tensor(name)
        ok = x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))
        if ok: same += 1
        else: differ.append(f"{name} ({x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)})")
        del x, y
    return {"tensors": len(a_map), "equal": same, "differ": differ[:5], "n_differ": len(differ), "missing": missing[:5],
            "n_missing": len(missing), "extra": extra[:5], "n_extra": len(extra)}


def _top2_gap(logits):
    "argmax and (top-1 − top-2) of float32 logits [..., V]."
    import numpy as np
    top2 = np.sort(np.partition(logits, -2, axis=-1)[..., -2:], axis=-1)
    return logits.argmax(-1), top2[..., 1] - top2[..., 0]


def child_logits(a, s):
    import numpy as np
    out = setup(a.side)
    ids = prompt_ids(s, 1, 128)
    ref = Path(a.workdir) / "hf_logits.npz"
    if a.side == "hf":
        import torch
        model, out["load_seconds"] = load_hf(a.ckpt)
        t0 = time.perf_counter()
        with torch.inference_mode(): logits = model(torch.tensor(ids)).logits.float().numpy()[0]
        out["seconds"] = time.perf_counter() - t0
        arg, gap = _top2_gap(logits)
        np.savez(ref, logits=logits, argmax=arg, gap=gap)
    else:
        lm, out["load_seconds"] = load_meshtx(a.ckpt)
        t0 = time.perf_counter()
        logits = np.asarray(lm.logits(ids), np.float32)[0]
        out["seconds"] = time.perf_counter() - t0   # the first call: compilation included
        out["again_seconds"] = timed(lambda: lm.logits(ids).block_until_ready(), 1)
        if ref.exists():
            r = np.load(ref)
            arg = logits.argmax(-1)
            clear = r["gap"] > 0.1
            out.update(agree=int((arg == r["argmax"]).sum()), positions=len(arg), clear=int(clear.sum()),
                       agree_clear=int((arg == r["argmax"])[clear].sum()),
                       max_abs_diff=float(np.abs(logits - r["logits"]).max()))
    out["peak"] = peak()
    return out


def child_generate(a, s):
    import numpy as np
    out = setup(a.side)
    ids = prompt_ids(s, 1, 32)
    ref = Path(a.workdir) / "hf_generate.npz"
    if a.side == "hf":
        import torch
        model, out["load_seconds"] = load_hf(a.ckpt)
        eos = model.config.eos_token_id
        t0 = time.perf_counter()
        x = torch.tensor(ids)
        with torch.inference_mode():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False, pad_token_id=eos,
                               output_logits=True, return_dict_in_generate=True)
        out["seconds"] = time.perf_counter() - t0
        tokens = g.sequences[0, ids.shape[1]:].numpy()
        gaps = np.array([_top2_gap(l[0].float().numpy())[1] for l in g.logits])
        np.savez(ref, tokens=tokens, gaps=gaps)
        out["tokens"] = len(tokens)
    else:
        lm, out["load_seconds"] = load_meshtx(a.ckpt)
        t0 = time.perf_counter()
        gen = lm.generate(ids.tolist(), max_new_tokens=32, temperature=0)
        out["seconds"] = time.perf_counter() - t0   # compilation included
        tokens = np.asarray(gen.tokens[0])
        out["tokens"] = len(tokens)
        if ref.exists():
            r = np.load(ref)
            hf_t, gaps = r["tokens"], r["gaps"]
            n = min(len(tokens), len(hf_t))
            diff = next((i for i in range(n) if tokens[i] != hf_t[i]), n if len(tokens) != len(hf_t) else None)
            out.update(hf_tokens=len(hf_t), equal_prefix=len(hf_t) if diff is None else int(diff))
            if diff is not None and diff < len(gaps): out["gap_at_divergence"] = float(gaps[diff])
    out["peak"] = peak()
    return out


def child_decode(a, s):
    "Decode tokens/s at batch `a.batch`: (t(N) − t(1)) over N − 1 tokens per row, both after a warm-up."
    out = setup(a.side)
    ids, N = prompt_ids(s, a.batch, 32), a.new
    if a.side == "hf":
        import torch
        model, out["load_seconds"] = load_hf(a.ckpt)
        x = torch.tensor(ids)
        def run(n):
            with torch.inference_mode():
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
    else:
        lm, out["load_seconds"] = load_meshtx(a.ckpt)
        prompts = ids.tolist()
        def run(n): lm.generate(prompts, max_new_tokens=n, temperature=0, eos_token_id=None)
        t0 = time.perf_counter(); run(N); run(1)
        out["compile_seconds"] = time.perf_counter() - t0
    tN, t1 = timed(lambda: run(N), a.repeats), timed(lambda: run(1), a.repeats)
    out.update(t_new=tN, t_one=t1, new=N, tokens_per_s=a.batch * (N - 1) / max(tN - t1, 1e-9),
               ms_per_step=1e3 * (tN - t1) / (N - 1), peak=peak())
    return out


def child_prefill(a, s):
    out = setup(a.side)
    ids = prompt_ids(s, 1, 512)
    if a.side == "hf":
        import torch
        model, out["load_seconds"] = load_hf(a.ckpt)
        x = torch.tensor(ids)
        def run():
            with torch.inference_mode(): model(x)
    else:
        lm, out["load_seconds"] = load_meshtx(a.ckpt)
        def run(): lm.logits(ids).block_until_ready()
    t = timed(run, a.repeats)
    out.update(seconds=t, tokens_per_s=ids.size / t, peak=peak())
    return out


def _memory_analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    alias = getattr(m, "alias_size_in_bytes", 0)
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes, "alias": alias,
            "temporaries": m.temp_size_in_bytes,
            "total": m.argument_size_in_bytes + m.output_size_in_bytes - alias + m.temp_size_in_bytes}


def _batches(s, seq):
    import numpy as np
    rng = np.random.default_rng(seq)
    while True: yield rng.integers(0, s["n_vocab"], (1, 1, seq + 1)).astype(np.int32)


def _train_steps(trainer, out):
    t0 = time.perf_counter(); rec = trainer.step(); out["first_step_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter(); rec = trainer.step(); out["step_seconds"] = time.perf_counter() - t0
    out.update(loss=rec["loss"], peak=peak())


def child_lora(a, s):
    import meshtx
    out = setup("meshtx")
    from meshtx import Trainer, LoRAConfig
    lm, out["load_seconds"] = load_meshtx(a.ckpt)
    data = _batches(s, a.seq)
    t = Trainer(lm, data, lora=LoRAConfig(rank=8), remat=True, progress=False)
    _train_steps(t, out)
    p = meshtx.plan(lm.config, mode="lora", batch=1, seq=a.seq, param_dtype=lm.config.param_dtype,
                    compute_dtype=lm.config.compute_dtype, lora_rank=8, remat=True)
    out["plan"] = p.total
    out["xla"] = _memory_analysis(t._step.lower(t.state, t._put(next(data)), t._frozen()).compile())
    return out


def child_train(a, s):
    "A full fine-tune step at the most layers (≤ 28) whose plan fits the budget."
    import meshtx
    out = setup("meshtx")
    from meshtx import LM, Trainer
    budget = a.budget * GB - out["baseline"]
    def planned(L):
        return meshtx.plan(cfg_meshtx({**s, "n_layer": L}), mode="train", batch=1, seq=a.seq, param_dtype="float32",
                           compute_dtype="bfloat16", remat=True).total
    fits = lambda budget: max((L for L in range(1, 29) if planned(L) * 1.1 <= budget), default=0)
    layers = fits(budget)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out.update(layers=layers, budget=a.budget * GB, plan_one_layer=planned(1), ram=ram, ram_layers=fits(0.9 * ram - out["baseline"]))
    if not layers: return out
    cfg = cfg_meshtx({**s, "n_layer": layers})
    t0 = time.perf_counter()
    lm = LM.init(cfg, seed=0, dtype="float32", compute_dtype="bfloat16", tokenizer=None)
    import jax; jax.block_until_ready(lm.params)
    out["init_seconds"] = time.perf_counter() - t0
    data = _batches(s, a.seq)
    t = Trainer(lm, data, remat=True, progress=False)
    _train_steps(t, out)
    out["plan"] = planned(layers)
    out["xla"] = _memory_analysis(t._step.lower(t.state, t._put(next(data)), t.frozen).compile())
    return out


def child_plan(a, s):
    "`meshtx.plan` against XLA's memory analysis of the compiled programs, all abstract (nothing allocated)."
    import jax, jax.numpy as jnp, meshtx
    out = setup("meshtx")
    sys.path.insert(0, str(HERE))
    from memory import step_memory
    from meshtx.model import gptj, param_shapes, KVCache
    S, res = a.seq, {}
    from meshtx.model import split_layers
    from meshtx.lora import split_adapters
    from meshtx.train import make_optimizer, make_train_step, TrainState
    # on one CPU device, LM and Trainer give the blocks' weights one layer at a time (`LM._weights`, `Trainer._frozen`)
    layered = jax.default_backend() == "cpu"
    for dtype in ("bfloat16", "float32"):
        cfg = cfg_meshtx(s, param_dtype=dtype, compute_dtype=dtype)
        # infer: the forward of a 1 × S prompt into an S-slot cache (donated), full logits
        model = gptj(cfg)
        cache = jax.eval_shape(lambda: KVCache.init(cfg, 1, S))
        layer_of = lambda x, i: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        params, layers = split_layers(param_shapes(cfg), layer_of) if layered else (param_shapes(cfg), None)
        fwd = jax.jit(lambda p, l, t, c: model.apply(p, t, None, c, layers=l), donate_argnums=3)
        xla = _memory_analysis(fwd.lower(params, layers, jax.ShapeDtypeStruct((1, S), jnp.int32), cache).compile())
        pl = meshtx.plan(cfg, mode="infer", batch=1, seq=S, param_dtype=dtype, compute_dtype=dtype)
        res[f"infer/{dtype}"] = {"plan": pl.total, "xla": xla["total"], "xla_detail": xla}
        # LoRA: rank 8, frozen weights in `dtype`, remat
        rc = cfg.replace(remat=True)
        if layered:   # the Trainer's own step, with the frozen base one layer at a time
            lcfg = meshtx.LoRAConfig(rank=8)
            frozen, trainable = split_adapters(jax.eval_shape(gptj(rc, lora=lcfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
            opt = make_optimizer()
            state = TrainState(trainable, jax.eval_shape(opt.init, trainable), jax.ShapeDtypeStruct((), jnp.int32))
            step = make_train_step(rc, opt, None, lcfg)
            xla = _memory_analysis(step.lower(state, jax.ShapeDtypeStruct((1, 1, S + 1), jnp.int32), split_layers(frozen, layer_of)).compile())
        else: xla = step_memory(rc, 1, S, lora=8)
        pl = meshtx.plan(rc, mode="lora", batch=1, seq=S, param_dtype=dtype, compute_dtype=dtype, lora_rank=8, remat=True)
        res[f"lora/{dtype}"] = {"plan": pl.total, "xla": xla["total"], "xla_detail": xla}
        # full step: float32 masters and moments, computing in `dtype`, remat
        tc = cfg_meshtx(s, param_dtype="float32", compute_dtype=dtype, remat=True)
        xla = step_memory(tc, 1, S, lora=0)
        pl = meshtx.plan(tc, mode="train", batch=1, seq=S, param_dtype="float32", compute_dtype=dtype, remat=True)
        res[f"train/{dtype}"] = {"plan": pl.total, "xla": xla["total"], "xla_detail": xla}
    out.update(results=res, seq=S, peak=peak())
    return out


def _lp_gap(top: dict) -> float:
    "The gap between the two likeliest log-probabilities of one `top_logprobs` entry (`{token id: log-probability}`)."
    a, b = sorted(top.values(), reverse=True)[:2]
    return float(a - b)


def child_slots(a, s):
    """Continuous batching: `2 × a.batch` requests of mixed prompt and output lengths, all waiting at t = 0, served
    FIFO by `Slots` (`a.batch` rows, each request joining as soon as a row is free) and by `generate` in FIFO batches
    of `a.batch` (each batch waits for its longest). Greedy, no end-of-text, so the lengths are the ones asked for."""
    import numpy as np, jax, types
    from meshtx.slots import Slots
    out = setup("meshtx")
    lm, out["load_seconds"] = load_meshtx(a.ckpt)
    R, rng = a.batch, np.random.default_rng([PROMPT_SEED, a.batch])
    V = min(s["n_vocab"], 50257)
    prompts = [rng.integers(0, V, rng.integers(8, 33)).tolist() for _ in range(2 * R)]
    news = rng.integers(2, a.new + 1, 2 * R).tolist()
    t0 = time.perf_counter()
    slots = Slots(lm, rows=R, eos_token_id=None)
    jax.block_until_ready(slots.state)
    out.update(rows=R, init_seconds=time.perf_counter() - t0, cache_bytes=2 * slots.state.cache.k.nbytes, max_len=slots.max_len,
               peak_after_init=peak())
    fns, repacks = slots._fns, [0]
    def repack(*args):
        repacks[0] += 1
        return fns.repack(*args)
    slots._fns = types.SimpleNamespace(join=fns.join, decode=fns.decode, repack=repack)

    def continuous():
        waiting, who, got, ends, t0 = list(range(len(prompts))), {}, {}, {}, time.perf_counter()
        while waiting or any(slots.busy):
            take, waiting = waiting[:len(slots.free())], waiting[len(slots.free()):]
            if take:
                for r, i in zip(slots.add([prompts[i] for i in take], max_new_tokens=[news[i] for i in take], temperature=0), take):
                    who[r] = i
            for f in slots.step(8):
                got[who[f.row]], ends[who[f.row]] = f.tokens, time.perf_counter() - t0
        return time.perf_counter() - t0, got, ends

    def static():
        got, ends, t0 = {}, {}, time.perf_counter()
        for b in range(0, len(prompts), R):
            g = lm.generate(prompts[b:b + R], max_new_tokens=news[b:b + R], temperature=0, eos_token_id=None)
            for j, toks in enumerate(g.tokens): got[b + j], ends[b + j] = list(toks), time.perf_counter() - t0
        return time.perf_counter() - t0, got, ends

    tokens = sum(news)
    for name, run in (("slots", continuous), ("static", static)):
        first, _, _ = run()                                     # compilation included
        best = min((run() for _ in range(a.repeats)), key=lambda x: x[0])
        wall, got, ends = best
        out[name] = dict(first_seconds=first, seconds=wall, tokens_per_s=tokens / wall, mean_latency=float(np.mean(list(ends.values()))),
                         max_latency=max(ends.values()), tokens=[got[i] for i in range(len(prompts))])
    out["repacks"] = repacks[0]
    a_, b_ = out["slots"].pop("tokens"), out["static"].pop("tokens")
    out["equal_requests"] = sum(x == y for x, y in zip(a_, b_))
    # where a request's tokens first differ from generate's, how close generate's top two were there (untimed run)
    gaps = []
    for b in range(0, len(prompts), R):
        g = lm.generate(prompts[b:b + R], max_new_tokens=news[b:b + R], temperature=0, eos_token_id=None, top_logprobs=2)
        gaps += [[_lp_gap(top) for top in row] for row in g.top_logprobs]
    divergences = [next((j for j, (x, y) in enumerate(zip(sl, st)) if x != y), None) for sl, st in zip(a_, b_)]
    out["gaps_at_divergence"] = [gaps[i][j] for i, j in enumerate(divergences) if j is not None and j < len(gaps[i])]
    out["requests"], out["new_tokens"] = len(prompts), tokens
    out["lengths_ok"] = all(len(x) == n for x, n in zip(a_, news))
    # a repack of a full set of rows, forced: its time, and what it adds to the high-water mark
    slots.add(prompts[:R], max_new_tokens=a.new, temperature=0)
    slots.step(4)
    before, ts = peak(), []
    for _ in range(2):   # the first may compile
        t0 = time.perf_counter()
        slots.state = fns.repack(slots.state, np.asarray(slots.busy))
        jax.block_until_ready(slots.state)
        ts.append(time.perf_counter() - t0)
    out.update(repack_seconds=ts[-1], repack_peak_rise=peak() - before, peak=peak())
    return out


CHILDREN = {"slots": child_slots, "write": child_write, "write-bin": child_write_bin, "bandwidth": child_bandwidth, "load": child_load,
            "hf-convert": child_hf_convert, "roundtrip": child_roundtrip, "logits": child_logits,
            "generate": child_generate, "decode": child_decode, "prefill": child_prefill, "lora": child_lora,
            "train": child_train, "plan": child_plan}


def run_as_child(a):
    child_env()
    s = shape(a)
    try: res = {"ok": True, **CHILDREN[a.child](a, s)}
    except BaseException as e:   # reported to the parent as the row's failure
        import traceback
        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"}
    res.setdefault("peak", peak())
    res["ru_maxrss"] = __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss * 1024
    sys.stdout.flush()
    print(MARK + json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


# ---------------------------------------------------------------------------------------------------------------------
# the parent: runs the children one at a time, watches them, prints the table

class Runner:
    def __init__(self, args, workdir: Path):
        self.args, self.workdir, self.procs = args, workdir, []
        self.n = 0

    def base_argv(self):
        a = self.args
        return [sys.executable, str(Path(__file__).resolve()), "--layers", str(a.layers), "--d-model", str(a.d_model),
                "--d-ff", str(a.d_ff or 4 * a.d_model), "--n-head", str(a.n_head), "--vocab", str(a.vocab),
                "--repeats", str(a.repeats), "--workdir", str(self.workdir)]

    def child(self, row, side, kind, *extra, timeout=None) -> dict:
        return self.run(row, side, kind, self.base_argv() + ["--child", kind, "--side", "hf" if side == "hf" else "meshtx", *extra],
                        timeout=timeout)

    def run(self, row, side, label, argv, timeout=None) -> dict:
        "Run `argv`; its wall time, exit, peaks (self-reported, wait4, psutil) and its JSON result, if it printed one."
        import psutil
        self.n += 1
        log = self.workdir / f"{self.n:02d}-{row}-{side}-{label}.log"
        env = dict(os.environ)
        n = str(os.cpu_count() or 1)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_CPP_MIN_LOG_LEVEL="3",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
                   XLA_FLAGS=" ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f))
        timeout = timeout or self.args.timeout
        cap = self.args.max_rss * GB if self.args.max_rss else None
        print(f"[{row}/{side}] {label} ...", end="", flush=True)
        load0 = os.getloadavg()[0]
        with open(log, "w") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True)
        t0, polled, anon, killed, status, ru = time.perf_counter(), 0, 0, None, None, None
        try:
            proc = psutil.Process(p.pid)
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid: break
                try:
                    mem = [q.memory_info() for q in [proc] + proc.children(recursive=True)]
                    now, now_anon = sum(m.rss for m in mem), sum(m.rss - m.shared for m in mem)
                except psutil.Error: now = now_anon = 0
                polled, anon = max(polled, now), max(anon, now_anon)
                if killed is None and cap and now_anon > cap: killed = "memory"   # mapped file pages can be dropped
                if killed is None and time.perf_counter() - t0 > timeout: killed = "time"
                if killed:
                    try: os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError: pass
                time.sleep(0.1)
        except BaseException:
            try: os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError: pass
            p.wait()
            raise
        wall = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        p.returncode = code
        res = {}
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(MARK): res = json.loads(line[len(MARK):])
        r = {"row": row, "side": side, "label": label, "exit": code, "wall": wall, "load": (load0, os.getloadavg()[0]), "polled_peak": polled, "polled_anon_peak": anon,
             "wait4_peak": ru.ru_maxrss * 1024, "killed": killed, "log": str(log), **res}
        r["peak"] = res.get("peak") or max(polled, r["wait4_peak"])
        if code != 0 and not res.get("error"):
            why = {"memory": f"killed: anonymous RSS above --max-rss {self.args.max_rss} GB", "time": f"killed: ran past --timeout {timeout} s"}
            r["error"] = why.get(killed) or (f"killed by signal {-code}" + (" (SIGKILL: out of memory?)" if code == -9 else "")
                                             if code < 0 else f"exit {code}: " + _tail(log))
        self.procs.append(r)
        print(f" {wall:.1f} s, peak {r['peak'] / GB:.2f} GB" + (f", FAILED: {r['error']}" if r.get("error") else ""), flush=True)
        return r


def _tail(log: Path) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip() and not l.startswith(MARK)]
    return lines[-1][:300] if lines else "(no output)"


def ensure_checkpoint(runner, s, cache: Path, kind: str, src: Path | None = None) -> Path:
    "The cached checkpoint (`kind` safetensors or bin), written first if missing: into a temporary sibling, then renamed."
    dest = cache / cache_name(s, kind)
    if is_complete(dest, s): return dest
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob(f".{dest.name}.tmp-*"):   # left by a killed run (its process is gone)
        try: alive = __import__("psutil").pid_exists(int(old.name.rsplit("-", 1)[1]))
        except ValueError: alive = False
        if not alive: shutil.rmtree(old, ignore_errors=True)
    tmp = cache / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    extra = ["--dest", str(tmp)] + (["--ckpt", str(src)] if src else [])
    r = runner.child("setup", "-", "write" if kind == "safetensors" else "write-bin", *extra, timeout=max(runner.args.timeout, 3600))
    if not r.get("ok"):
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"writing the {kind} checkpoint failed: {r.get('error')} (log: {r['log']})")
    if dest.exists(): shutil.rmtree(dest)   # an incomplete or outdated one
    os.rename(tmp, dest)
    return dest


def same_start(d: Path):
    """Put the page cache in the same state before each loading process: dropped (where this process may: root), then
    holding the checkpoint `d`. Without it each loader inherits the state the last process left, which at the 6B shape
    on a 24 GB machine swung HF's load between 8.5 and 40 s."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f: f.write("3\n")
    except OSError: pass
    warm_page_cache(d)


def warm_page_cache(d: Path):
    "Read the checkpoint's files once, so that the first loader does not pay the disk and the second get the page cache."
    for p in sorted(d.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20): pass


def dir_size(d: Path) -> int: return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------------------
# the table

def fig(row, figure, meshtx=None, hf=None, unit="", ratio=None, target="", met=None, note=""):
    return dict(row=row, figure=figure, meshtx=meshtx, hf=hf, unit=unit, ratio=ratio, target=target, met=met, note=note)


def _num(v, unit=""):
    if v is None: return "—"
    if isinstance(v, str): return v
    return f"{v:,.3g} {unit}".strip() if abs(v) < 1000 else f"{v:,.0f} {unit}".strip()


def _failed(r):
    return None if r is None or r.get("ok") else (r.get("error") or "failed")


def summarize(row, rs: dict, W: int, s: dict, ctx: dict) -> list:
    "Figures of one row from its children's results `rs` (side -> result)."
    m, h = rs.get("meshtx"), rs.get("hf")
    ok = lambda r: r is not None and r.get("ok")
    out = []
    def fail_rows():
        for side, r in rs.items():
            if r is not None and not r.get("ok"):
                out.append(fig(row, f"{side} failed", meshtx=r["error"] if side != "hf" else None,
                               hf=r["error"] if side == "hf" else None, met=False if side != "hf" else None,
                               note=f"peak {r['peak'] / GB:.2f} GB at exit (log {Path(r['log']).name})"))
    w = W / GB
    if row == "load":
        mt, ht = m and ok(m) and m["seconds"], h and ok(h) and h["seconds"]
        out.append(fig(row, "wall s (the load call)", mt or None, ht or None, "s", ht / mt if mt and ht else None, "≤ HF's",
                       (mt <= ht) if mt and ht else None))
        mp, hp = (m or {}).get("peak"), (h or {}).get("peak")
        out.append(fig(row, f"peak RSS GB (weights {w:.2f})", mp and mp / GB, hp and hp / GB, "GB",
                       hp / mp if mp and hp else None, f"≤ weights + 1 = {w + 1:.2f}", mp <= W + GB if ok(m) else False))
    elif row == "convert":
        cli = [r for k, r in rs.items() if k.startswith("cli")]
        rt = rs.get("roundtrip")
        cli_ok = len(cli) == 2 and all(r["exit"] == 0 for r in cli)
        mt = sum(r["wall"] for r in cli) if cli_ok else None
        ht = h["wall"] if ok(h) else None
        out.append(fig(row, "wall s (2 CLI processes; HF: one process, load + save_pretrained)", mt, ht, "s",
                       ht / mt if mt and ht else None, f"≤ 2× HF's" + (f" = {2 * ht:.3g} s" if ht else ""),
                       (mt <= 2 * ht) if mt and ht else None,
                       note=" + ".join(f"{r['wall']:.1f}" for r in cli) + " s" if cli else ""))
        mp = max((r["peak"] for r in cli), default=None)
        shard = ctx["largest_shard"]
        out.append(fig(row, f"peak RSS GB (weights {w:.2f}, largest shard {shard / GB:.2f})", mp and mp / GB,
                       h and h["peak"] / GB, "GB", h["peak"] / mp if mp and h else None,
                       f"≤ weights + one shard = {(W + shard) / GB:.2f}", (mp <= W + shard) if cli_ok else False,
                       note=" / ".join(f"{r['peak'] / GB:.2f}" for r in cli) + " GB" if cli else ""))
        if ok(rt):
            exact = rt["equal"] == rt["tensors"] and not rt["n_extra"]
            txt = f"{rt['equal']}/{rt['tensors']} tensors bit-exact"
            if rt["n_differ"]: txt += f"; differ: {', '.join(rt['differ'])}"
            if rt["n_missing"]: txt += f"; missing: {', '.join(rt['missing'])}"
            if rt["n_extra"]: txt += f"; extra: {', '.join(rt['extra'])}"
            out.append(fig(row, "round trip HF → meshtx → HF", txt, target="bit-exact", met=exact))
        else:
            out.append(fig(row, "round trip HF → meshtx → HF", "not checked (a conversion failed)", target="bit-exact", met=False))
        for r in cli:
            if r["exit"] != 0: out.append(fig(row, f"{r['label']} failed", r["error"], met=False, note=f"log {Path(r['log']).name}"))
        if h is not None and not ok(h): out.append(fig(row, "HF failed", hf=h["error"]))
        return out
    elif row == "logits":
        if ok(m) and "agree" in m:
            need = -(-95 * m["positions"] // 100)
            out.append(fig(row, "argmax equals HF's (1 × 128)", f"{m['agree']}/{m['positions']}", target=f"≥ 95 % ({need})",
                           met=m["agree"] >= need, note=f"where HF's top-2 gap > 0.1: {m['agree_clear']}/{m['clear']}; "
                                                        f"max |logit diff| {m['max_abs_diff']:.3g}"))
        elif ok(m): out.append(fig(row, "argmax equals HF's (1 × 128)", "no HF reference", target="≥ 95 %"))
        out.append(fig(row, "first call s (compile included); HF: forward", m and ok(m) and m["seconds"] or None,
                       h and ok(h) and h["seconds"] or None, "s",
                       note=f"meshtx again: {m['again_seconds']:.3g} s" if ok(m) else ""))
        out.append(_peak_fig(row, m, h, W, 2))
    elif row == "generate":
        if ok(m) and "equal_prefix" in m:
            n, k = m["hf_tokens"], m["equal_prefix"]
            gap = m.get("gap_at_divergence")
            if k >= n and m["tokens"] == n: txt, met = f"{n}/{n} equal", True
            else:
                txt = f"equal for the first {k} of {n}" + (f", then differ where HF's top-2 gap is {gap:.3g}" if gap is not None else "")
                met = gap is not None and gap <= 0.1
            out.append(fig(row, "greedy tokens equal HF's", txt, target="equal wherever HF's top-2 gap > 0.1", met=met,
                           note="after a divergence the prefixes differ: nothing later is compared"))
        elif ok(m): out.append(fig(row, "greedy tokens equal HF's", "no HF reference", target="equal where gap > 0.1"))
        out.append(fig(row, "first generate s (compile included)", m and ok(m) and m["seconds"] or None,
                       h and ok(h) and h["seconds"] or None, "s"))
        out.append(_peak_fig(row, m, h, W, 2))
    elif row in ("decode1", "decode16", "prefill"):
        mt, ht = (m or {}).get("tokens_per_s") if ok(m) else None, (h or {}).get("tokens_per_s") if ok(h) else None
        label = {"decode1": "decode tok/s, batch 1", "decode16": "decode tok/s, batch 16", "prefill": "prefill tok/s, 1 × 512"}[row]
        need = 1.25 if row == "decode1" else 1.0
        out.append(fig(row, label, mt, ht, "tok/s", mt / ht if mt and ht else None, f"≥ {need:g}× HF's",
                       (mt >= need * ht) if mt and ht else None,
                       note=f"{m['ms_per_step']:.1f} ms/step; compile {m['compile_seconds']:.1f} s" if ok(m) and "ms_per_step" in m else ""))
        if row == "decode1":
            bw = ctx.get("bandwidth")
            if mt and bw:
                frac = W * mt / bw
                read = W - s["n_vocab"] * s["d_model"] * 2   # a step reads every weight but the embedding table
                out.append(fig(row, f"share of the read-bandwidth limit ({bw / GB:.1f} GB/s ÷ {w:.2f} GB = {bw / W:.3g} tok/s)",
                               f"{frac:.0%}", f"{W * ht / bw:.0%}" if ht else None, target="≥ 50 %", met=frac >= 0.5,
                               note=f"{read * mt / bw:.0%} (HF {read * ht / bw:.0%}) counting only the {read / GB:.2f} GB a step "
                                    f"reads (not the embedding table)" if ht else
                                    f"{read * mt / bw:.0%} counting only the {read / GB:.2f} GB a step reads (not the embedding table)"))
            else: out.append(fig(row, "share of the read-bandwidth limit", "not measured", target="≥ 50 %", met=False if not mt else None))
    elif row == "slots":
        if ok(m):
            sl, st = m["slots"], m["static"]
            out.append(fig(row, f"throughput, {m['requests']} requests in {m['rows']} rows (meshtx: slots; HF column: generate in FIFO batches)",
                           sl["tokens_per_s"], st["tokens_per_s"], "tok/s", sl["tokens_per_s"] / st["tokens_per_s"],
                           "≥ generate's", sl["tokens_per_s"] >= st["tokens_per_s"],
                           note=f"{m['new_tokens']} new tokens; first runs (compiles included) {sl['first_seconds']:.1f} / {st['first_seconds']:.1f} s; "
                                f"{m['repacks']} repack(s) on the way"))
            out.append(fig(row, "mean latency s (all requests waiting at t = 0)", sl["mean_latency"], st["mean_latency"], "s",
                           st["mean_latency"] / sl["mean_latency"], "≤ generate's", sl["mean_latency"] <= st["mean_latency"],
                           note=f"longest {sl['max_latency']:.3g} / {st['max_latency']:.3g} s"))
            gaps = m.get("gaps_at_divergence")
            near = gaps is not None and len(gaps) == m["requests"] - m["equal_requests"] and all(g <= 0.1 for g in gaps)
            out.append(fig(row, "greedy tokens equal generate's", f"{m['equal_requests']}/{m['requests']} requests",
                           target="equal wherever generate's top-2 gap > 0.1", met=(m["equal_requests"] == m["requests"] or near) and m["lengths_ok"],
                           note="" if gaps is None or not gaps else
                           f"the others first differ where generate's top-2 gap is {', '.join(f'{g:.3g}' for g in sorted(gaps))}"))
            cache = m["cache_bytes"]
            out.append(fig(row, f"peak RSS GB (weights {w:.2f}, cache {cache / GB:.2f}: {m['rows']} rows × {m['max_len']} slots)", m["peak"] / GB,
                           unit="GB", target=f"≤ weights + cache + 2 = {(W + cache) / GB + 2:.2f}", met=m["peak"] <= W + cache + 2 * GB,
                           note=f"a forced repack took {m['repack_seconds']:.2f} s and raised the high-water mark by "
                                f"{m['repack_peak_rise'] / GB:.2f} GB"))
    elif row in ("lora128", "lora512", "train"):
        if ok(m) and row == "train" and not m.get("layers"):
            out.append(fig(row, "layers that fit", "none", target="runs", met=False,
                           note=f"1 layer plans {m['plan_one_layer'] / GB:.2f} GB (+ 10 %) > budget {m['budget'] / GB:.1f} GB − "
                                f"{m['baseline'] / GB:.2f} GB runtime (--train-budget); 90 % of this machine's "
                                f"{m['ram'] / GB:.0f} GB RAM would fit {m['ram_layers']} layer(s)"))
        elif ok(m):
            grow = m["peak"] - m["baseline"]
            if row == "train": out.append(fig(row, f"layers (most that fit {m['budget'] / GB:.1f} GB by plan)", f"{m['layers']}"))
            out.append(fig(row, "step s (second step; first incl. compile)", m["step_seconds"], unit="s",
                           note=f"first {m['first_step_seconds']:.1f} s; loss {m['loss']:.3f}"))
            out.append(fig(row, "peak RSS − baseline, GB (ratio: ÷ plan)", grow / GB, None, "GB", grow / m["plan"],
                           f"within 10 % of plan's {m['plan'] / GB:.2f}", abs(grow - m["plan"]) <= 0.1 * m["plan"],
                           note=f"XLA's analysis of the step {m['xla']['total'] / GB:.2f} GB "
                                f"(temporaries {m['xla']['temporaries'] / GB:.2f}); peak RSS {m['peak'] / GB:.2f}, "
                                f"baseline {m['baseline'] / GB:.2f} GB"))
    elif row == "plan":
        if ok(m):
            for key, v in m["results"].items():
                mode, dtype = key.split("/")
                d = {"alias": 0, "outputs": 0, **v["xla_detail"]}
                if "outputs" not in v["xla_detail"]:   # bench/memory.py's step_memory: total − arguments − temporaries
                    d["outputs"] = d["total"] - d["arguments"] - d["temporaries"]
                target = dtype == "bfloat16"
                out.append(fig(row, f"{mode}, 1 × {m['seq']}, {dtype}: plan GB (ratio: ÷ XLA's)", v["plan"] / GB, None, "GB",
                               v["plan"] / v["xla"], f"within 10 % of XLA's {v['xla'] / GB:.3g}" if target
                               else f"info: XLA's {v['xla'] / GB:.3g}", abs(v["plan"] - v["xla"]) <= 0.1 * v["xla"] if target else None,
                               note=f"XLA: arguments {d['arguments'] / GB:.2f} + outputs {d['outputs'] / GB:.2f} − aliased "
                                    f"{d['alias'] / GB:.2f} + temporaries {d['temporaries'] / GB:.2f} GB"))
    elif row == "bin":
        st = ctx.get("load_peak")
        if ok(m):
            out.append(fig(row, "torch imported while loading", "yes" if m.get("torch_imported") else "no", target="no",
                           met=not m.get("torch_imported")))
        mt, ht = m and ok(m) and m["seconds"], h and ok(h) and h["seconds"]
        out.append(fig(row, "wall s (the load call; HF with torch)", mt or None, ht or None, "s", ht / mt if mt and ht else None))
        mp = m["peak"] if ok(m) else None
        out.append(fig(row, f"peak RSS GB (weights {w:.2f})", mp and mp / GB, h and h["peak"] / GB, "GB",
                       target=f"≤ safetensors load's + 10 %" + (f" = {1.1 * st / GB:.2f}" if st else ""),
                       met=(mp <= 1.1 * st) if mp and st else (False if m is not None and not ok(m) else None)))
    fail_rows()
    return out


def _peak_fig(row, m, h, W, extra_gb):
    mp = m["peak"] if m is not None else None
    return fig(row, f"peak RSS GB (weights {W / GB:.2f})", mp and mp / GB, h and h["peak"] / GB, "GB",
               h["peak"] / mp if mp and h else None, f"≤ weights + {extra_gb} = {W / GB + extra_gb:.2f}",
               (mp <= W + extra_gb * GB) if m is not None and m.get("ok") else (False if m is not None else None))


def print_table(figs, procs, args, s, W, env):
    print(f"\n### scale — GPT-J-6B width, {s['n_layer']} layer(s) (d_model {s['d_model']}, d_ff {s['d_ff']}, "
          f"{s['n_head']} heads, vocab {s['n_vocab']}): {n_params(s) / 1e9:.3f} B parameters, weights {W / GB:.2f} GB in bf16 · "
          f"commit {env['commit']} · {env['cpus']} CPUs, {env['ram'] / 2**30:.0f} GiB RAM")
    print("| row | figure | meshtx | HF | ratio | target | met? | note |")
    print("|---|---|---|---|---|---|---|---|")
    for f in figs:
        met = {True: "✔", False: "✘", None: "—"}[f["met"]]
        ratio = f"{f['ratio']:.2f}×" if isinstance(f["ratio"], (int, float)) else "—"
        print(f"| {f['row']} | {f['figure']} | {_num(f['meshtx'], f['unit'])} | {_num(f['hf'], f['unit'])} | {ratio} | "
              f"{f['target'] or '—'} | {met} | {f['note']} |")
    print("\n| row | side | process | exit | wall s | peak RSS GB (self) | wait4 GB | psutil GB | psutil anon GB | weights GB | load 1 min |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in procs:
        exit_ = str(r["exit"]) + (f" ({r['killed']})" if r.get("killed") else "")
        selfpk = f"{r['peak'] / GB:.2f}" if "ok" in r else "—"   # processes that print no result (the CLI) report none
        print(f"| {r['row']} | {r['side']} | {r['label']} | {exit_} | {r['wall']:.1f} | {selfpk} | "
              f"{r['wait4_peak'] / GB:.2f} | {r['polled_peak'] / GB:.2f} | {r['polled_anon_peak'] / GB:.2f} | {W / GB:.2f} | "
              f"{r['load'][0]:.1f} → {r['load'][1]:.1f} |")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------------------------

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="blocks at the 6B width (default 28: GPT-J-6B)")
    p.add_argument("--d-model", type=int, default=4096, help="width override, for smoke tests (default 4096)")
    p.add_argument("--d-ff", type=int, default=None, help="MLP width (default 4 × d_model)")
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50400)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "meshtx" / "scale"), help="where the checkpoints are kept")
    p.add_argument("--no-hf", action="store_true", help="meshtx only (no HF processes; no parity checks)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process (default 3600)")
    p.add_argument("--max-rss", type=float, default=None,
                   help="kill a child whose anonymous RSS (its own memory, not mapped file pages; with its children) "
                        "exceeds this many GB (default 90 %% of RAM)")
    p.add_argument("--train-budget", type=float, default=None,
                   help="GB the full fine-tune may plan for (default: --max-rss minus 10 %%)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (the fastest counts; default 3; 1: also one load round and one bandwidth probe)")
    p.add_argument("--new", type=int, default=64, help="new tokens in the decode-speed rows (default 64)")
    p.add_argument("--json", help="append the table's rows (and the processes) as JSON lines to this file")
    p.add_argument("--keep", action="store_true", help="keep the run's work directory (logs, converted checkpoints)")
    # for the children
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--side", default="meshtx", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--dest", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-shard-size", default="2GB", help=argparse.SUPPRESS)
    p.add_argument("--no-torch", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.child: return run_as_child(args)
    import psutil
    sys.path.insert(0, str(HERE))
    from common import commit
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad: raise SystemExit(f"unknown rows {bad}; choose from {ROWS}")
    ram = psutil.virtual_memory().total
    if args.max_rss is None: args.max_rss = round(0.9 * ram / GB, 1)
    if args.train_budget is None: args.train_budget = 0.9 * args.max_rss
    s = shape(args)
    W = 2 * n_params(s)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "meshtx"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    env = {"commit": commit() + (" + uncommitted changes in meshtx/" if dirty else ""), "cpus": os.cpu_count(), "ram": ram, "date": time.strftime("%Y-%m-%d")}
    workdir = Path(tempfile.mkdtemp(prefix="meshtx-scale-"))
    runner = Runner(args, workdir)
    print(f"scale: {n_params(s) / 1e9:.3f} B parameters ({W / GB:.2f} GB bf16), rows {','.join(rows)}; work dir {workdir}", flush=True)
    figs, ctx = [], {}
    try:
        cache = Path(args.cache).expanduser()
        st = ensure_checkpoint(runner, s, cache, "safetensors")
        ctx["largest_shard"] = max(p.stat().st_size for p in st.glob("*.safetensors"))
        print(f"checkpoint: {st} ({len(list(st.glob('*.safetensors')))} shards, {dir_size(st) / GB:.2f} GB)", flush=True)
        if "bin" in rows:
            bn = ensure_checkpoint(runner, s, cache, "bin", src=st)
            print(f"checkpoint: {bn} ({dir_size(bn) / GB:.2f} GB)", flush=True)
        hf = not args.no_hf
        if "decode1" in rows:
            r = runner.child("setup", "-", "bandwidth")
            ctx["bandwidth"] = r.get("bandwidth")
        if {"load", "convert", "bin"} & set(rows): warm_page_cache(st)
        for row in rows:
            rs = {}
            if row == "load":
                for _ in range(min(LOAD_ROUNDS, args.repeats)):   # alternating, each from the same page-cache state; the fastest counts
                    for side in (["hf"] if hf else []) + ["meshtx"]:
                        same_start(st)
                        r = runner.child(row, side, "load", "--ckpt", str(st))
                        if side not in rs or (r.get("ok") and (not rs[side].get("ok") or r["seconds"] < rs[side]["seconds"])): rs[side] = r
                if rs["meshtx"].get("ok"): ctx["load_peak"] = rs["meshtx"]["peak"]
            elif row == "convert":
                limit = f"{shard_limit(s) // 10**6}MB"
                if hf:
                    out = workdir / "hf-saved"
                    rs["hf"] = runner.child(row, "hf", "hf-convert", "--ckpt", str(st), "--dest", str(out), "--max-shard-size", limit)
                    shutil.rmtree(out, ignore_errors=True)
                mid, back = workdir / "meshtx-ckpt", workdir / "hf-back"
                rs["cli1"] = runner.run(row, "meshtx", "convert HF→meshtx",
                                        [sys.executable, "-m", "meshtx", "convert", str(st), str(mid), "-q"])
                if rs["cli1"]["exit"] == 0:
                    ctx["meshtx_ckpt_size"] = dir_size(mid)
                    rs["cli2"] = runner.run(row, "meshtx", "convert meshtx→HF",
                                            [sys.executable, "-m", "meshtx", "convert", str(mid), str(back), "--max-shard-size", limit, "-q"])
                    shutil.rmtree(mid, ignore_errors=True)
                    if rs["cli2"]["exit"] == 0:
                        rs["roundtrip"] = runner.child(row, "-", "roundtrip", "--ckpt", str(st), "--dest", str(back))
                    shutil.rmtree(back, ignore_errors=True)
            elif row in ("logits", "generate", "prefill"):
                if hf: rs["hf"] = runner.child(row, "hf", row, "--ckpt", str(st))
                rs["meshtx"] = runner.child(row, "meshtx", row, "--ckpt", str(st))
            elif row in ("decode1", "decode16"):
                b = "1" if row == "decode1" else "16"
                if hf: rs["hf"] = runner.child(row, "hf", "decode", "--ckpt", str(st), "--batch", b, "--new", str(args.new))
                rs["meshtx"] = runner.child(row, "meshtx", "decode", "--ckpt", str(st), "--batch", b, "--new", str(args.new))
            elif row == "slots":
                rs["meshtx"] = runner.child(row, "meshtx", "slots", "--ckpt", str(st), "--batch", "8", "--new", str(min(args.new, 48)))
            elif row in ("lora128", "lora512"):
                rs["meshtx"] = runner.child(row, "meshtx", "lora", "--ckpt", str(st), "--seq", row[4:])
            elif row == "train":
                rs["meshtx"] = runner.child(row, "meshtx", "train", "--seq", "128", "--budget", str(args.train_budget))
            elif row == "plan":
                rs["meshtx"] = runner.child(row, "meshtx", "plan", "--seq", "512")
            elif row == "bin":
                if hf:
                    same_start(bn)
                    rs["hf"] = runner.child(row, "hf", "load", "--ckpt", str(bn))
                same_start(bn)
                rs["meshtx"] = runner.child(row, "meshtx", "load", "--ckpt", str(bn), "--no-torch")
            if row == "decode1" and rs["meshtx"].get("ok") and args.repeats > 1:   # a second probe: a limit is the best the machine reads
                r = runner.child("setup", "-", "bandwidth")
                ctx["bandwidth"] = max(filter(None, [ctx.get("bandwidth"), r.get("bandwidth")]), default=None)
            figs += summarize(row, rs, W, s, ctx)
    finally:
        if not args.keep: shutil.rmtree(workdir, ignore_errors=True)
    print_table(figs, runner.procs, args, s, W, env)
    if args.json:
        with open(args.json, "a") as f:
            for x in figs: f.write(json.dumps({"bench": "scale", **env, "layers": s["n_layer"], "shape": s, "weights": W, **x}) + "\n")
            for r in runner.procs:
                keep = {k: v for k, v in r.items() if k not in ("log",)}
                f.write(json.dumps({"bench": "scale-process", **env, "layers": s["n_layer"], **keep}, default=str) + "\n")
    return 0


if __name__ == "__main__": sys.exit(main())
