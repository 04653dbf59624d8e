"""Forward (prefill) speed: logits of `--batch` sequences of `--seq` tokens, meshtx `lm.logits` against HF's forward."""
import numpy as np
from common import parser, config, models, timed, report, default_dtype, limits, sync_torch, torch_device


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    cfg, dtype = config(args), default_dtype(args)
    lm, hf = models(cfg, dtype, hf=not args.no_hf)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (args.batch, args.seq))
    t = timed(lambda: lm.logits(tokens).block_until_ready(), args.repeats)
    if cfg.attention != "xla":   # another attention kernel must give the same logits as the einsum
        from meshtx import LM
        plain = LM(cfg.replace(attention="xla"), lm.params, None)
        err = float(np.abs(np.asarray(lm.logits(tokens[:1, :256])) - np.asarray(plain.logits(tokens[:1, :256]))).max())
        print(f"(attention={cfg.attention} vs xla: max |logit difference| = {err:.2e})")
    t_hf = None
    if hf is not None:
        import torch
        ids = torch.tensor(tokens, device=torch_device())
        def run_hf():
            with torch.no_grad(): hf(ids)
            sync_torch()
        t_hf = timed(run_hf, args.repeats)
    n = args.batch * args.seq
    flops = 2 * cfg.n_params * n + 2 * cfg.n_layer * args.batch * args.seq ** 2 * cfg.d_model   # matmuls + attention
    lim = limits()
    rows = [dict(figure="prefill tokens/s", meshtx=n / t, hf=n / t_hf if t_hf else None, unit="tok/s",
                 limit=flops / t / lim[0] if lim else None)]
    report("prefill", rows, args, f"(batch {args.batch} × {args.seq} tokens; limit = peak bf16 FLOP/s)")
    return rows


if __name__ == "__main__": main()
