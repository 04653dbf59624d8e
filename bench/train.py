"""Training speed: one full fine-tune step (AdamW, clip 1.0) on `--batch` × `--seq` tokens, meshtx `Trainer.step`
against a PyTorch step of HF's model (forward, backward, clip, AdamW). MFU counts 6·N·tokens plus attention
(12·layers·seq·d_model per token, forward + backward) against the chip's peak bf16 FLOP/s."""
import itertools
import numpy as np
from common import parser, config, models, timed, report, default_dtype, limits, sync_torch, torch_device


def train_flops(cfg, batch, seq):
    return batch * seq * (6 * cfg.n_params + 12 * cfg.n_layer * seq * cfg.d_model)


def hf_step(model, ids, lr=1e-4, checkpointing=False, peft=False):
    "A closure running one PyTorch training step of `model` on `ids`."
    import torch
    model.train()
    if checkpointing: model.gradient_checkpointing_enable()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        sync_torch()
    return step


def main(argv=None, lora: int = 0):
    p = parser(__doc__)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--checkpointing", action="store_true", help="remat in meshtx, gradient checkpointing in HF")
    args = p.parse_args(argv)
    from meshtx.train import Trainer
    cfg, dtype = config(args), default_dtype(args)
    if args.checkpointing: cfg = cfg.replace(remat=True)
    lm, hf = models(cfg, dtype, hf=not args.no_hf)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (1, args.batch, args.seq + 1))
    t_hf = peak_hf = None
    if hf is not None:   # PyTorch first, then its memory goes back to the driver before meshtx trains
        import gc, torch
        if lora:
            from peft import LoraConfig, get_peft_model
            hf = get_peft_model(hf, LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=0.0,
                                               target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]))
        else: hf = hf.float() if dtype == "float32" else hf
        ids = torch.tensor(tokens[0, :, :-1], device=torch_device())
        if torch.cuda.is_available(): torch.cuda.reset_peak_memory_stats()
        t_hf = timed(hf_step(hf, ids, checkpointing=args.checkpointing), args.repeats)
        if torch.cuda.is_available(): peak_hf = torch.cuda.max_memory_allocated() / 2**30
        del hf, ids; gc.collect()
        if torch.cuda.is_available(): torch.cuda.empty_cache()
    # the same recipe as the PyTorch side: weights and Adam moments in the benchmark's dtype
    kw = dict(lora=lora) if lora else dict(param_dtype=dtype, mu_dtype=dtype)
    t_ = Trainer(lm, itertools.repeat(tokens), lr=1e-4, progress=False, **kw)
    t = timed(t_.step, args.repeats)
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None
    n = args.batch * args.seq
    lim = limits()
    rows = [dict(figure=f"{'LoRA' if lora else 'full'} train tokens/s", meshtx=n / t, hf=n / t_hf if t_hf else None,
                 unit="tok/s", limit=train_flops(cfg, args.batch, args.seq) / t / lim[0] if lim and not lora else None)]
    if peak is not None or peak_hf is not None:
        rows.append(dict(figure="peak device memory", meshtx=peak, hf=peak_hf, unit="GiB", lower_is_better=True))
    report("lora" if lora else "train", rows, args,
           f"(batch {args.batch} × seq {args.seq}; {'LoRA rank ' + str(lora) + ' on q,k,v,out,fc_in,fc_out' if lora else 'AdamW'}; "
           f"limit = MFU against peak bf16 FLOP/s)")
    return rows


if __name__ == "__main__": main()
