"""Generation speed: greedy decoding of `--new` tokens after a `--prompt`-token prompt, batch 1 and `--batch`.
meshtx `lm.generate` against HF `model.generate(do_sample=False)`; tokens/s counts generated tokens only.
On an accelerator, batch-1 decode is bounded by reading every weight once per token: limit = bandwidth / weight bytes."""
import numpy as np
from common import parser, config, models, timed, report, default_dtype, limits, sync_torch, torch_device, read_bandwidth


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--profile", action="store_true", help="also trace one batch-1 generation and print its costliest ops")
    p.add_argument("--cache-read", default="auto", choices=["auto", "chunks", "all"],
                   help="how meshtx's decoding steps read the KV cache (ModelConfig.cache_read)")
    p.add_argument("--compare-cache-reads", action="store_true",
                   help="also time meshtx with the other way of reading the cache (no HF rows for those)")
    args = p.parse_args(argv)
    import meshtx.sampling  # noqa: F401
    from meshtx import LM
    from meshtx.model import cache_read
    cfg, dtype = config(args).replace(cache_read=args.cache_read), default_dtype(args)
    lm, hf = models(cfg, dtype, hf=not args.no_hf)
    read = cache_read(lm.config)
    weight_bytes = cfg.n_params * (2 if dtype in ("bfloat16", "float16") else 4)
    lim = limits()
    rows = []
    batches = sorted({1, args.batch})
    prompts = {B: np.random.default_rng(B).integers(0, cfg.n_vocab, (B, args.prompt)).tolist() for B in batches}
    def seconds(lm, B):
        return timed(lambda: lm.generate(prompts[B], max_new_tokens=args.new, temperature=0, eos_token_id=None), args.repeats)
    for B in batches:
        t = seconds(lm, B)
        t_hf = None
        if hf is not None:
            import torch
            ids = torch.tensor(prompts[B], device=torch_device())
            def run_hf():
                with torch.no_grad():
                    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                                do_sample=False, pad_token_id=0)
                sync_torch()
            t_hf = timed(run_hf, args.repeats)
        tok, tok_hf = B * args.new / t, (B * args.new / t_hf if t_hf else None)
        frac = (tok / B) / (lim[1] / weight_bytes) if lim and B == 1 else None
        rows.append(dict(figure=f"decode tokens/s, batch {B}", meshtx=tok, hf=tok_hf, unit="tok/s", limit=frac))
        if B == 1:
            rows.append(dict(figure="ms per token, batch 1", meshtx=1000 * t / args.new, hf=1000 * t_hf / args.new if t_hf else None,
                             unit="ms", lower_is_better=True))
    bw = read_bandwidth(2**32 if lim else 2**28)   # 4 GiB on an accelerator, 256 MiB on a CPU
    rows.append(dict(figure="device read bandwidth, measured (a sum over an array)", meshtx=bw / 1e9, unit="GB/s"))
    rows.append(dict(figure="batch-1 decode, share of the limit that bandwidth sets", unit="%",
                     meshtx=100 * rows[0]["meshtx"] / (bw / weight_bytes)))
    report("decode", rows, args, f"(prompt {args.prompt} tokens, {args.new} new tokens, greedy; meshtx cache_read={read!r}; "
                                  f"limit = bandwidth / {weight_bytes / 1e9:.2f} GB of weights per token: the data sheet's "
                                  f"bandwidth in the last column, the measured read bandwidth in the last row)")
    if args.profile:
        from common import top_ops, print_top_ops
        prompt = np.random.default_rng(1).integers(0, cfg.n_vocab, (1, args.prompt)).tolist()
        trace = top_ops(lambda: lm.generate(prompt, max_new_tokens=args.new, temperature=0, eos_token_id=None))
        print_top_ops(f"Costliest ops of one batch-1 generation ({args.new} new tokens, traced):", trace)
    if args.compare_cache_reads:   # the same weights read the other way, meshtx only; each row printed as soon as it is measured
        other = LM(lm.config.replace(cache_read="chunks" if read == "all" else "all"), lm.params)
        for B in batches:
            t = seconds(other, B)
            row = dict(figure=f"decode tokens/s, batch {B}, cache_read={other.config.cache_read!r}", meshtx=B * args.new / t,
                       hf=None, unit="tok/s", limit=(args.new / t) / (lim[1] / weight_bytes) if lim and B == 1 else None)
            report(f"decode, cache_read={other.config.cache_read!r}", [row], args)
            rows.append(row)
    return rows


if __name__ == "__main__": main()
