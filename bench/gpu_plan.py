"""XLA:GPU's memory analysis of meshtx's programs on a machine without a GPU, for `meshtx.plan`'s GPU rules.

JAX's CUDA plugin can compile for an NVIDIA GPU it does not have: a deviceless topology made from a description of
the target (compute capability, memory, SM count), then `jit(...).lower(...).compile()` as usual. The compiled
program's buffer assignment (`memory_analysis()`) is what the chip would allocate, less what autotuning on a real
device might change (it is off here: XLA picks its kernels by heuristics). Nothing runs and nothing is allocated.

    bash bench/gpu_plan.sh                     # installs the plugin for this JAX (once, cached), then runs the rows
    python bench/gpu_plan.py h100 '[["infer", "gptj-6b", 1, 128, 2048], ["lora", "gptj-6b", 1, 2048, "bfloat16", 1, 1, null, 1], ...]'

Rows: `["infer", preset, batch, prompt, slots]` is `generate`'s prefill (a prompt into a donated cache of `slots`, the
last position's logits, bf16 weights) on one GPU; `["train" | "lora", preset, batch, seq, dtype, fsdp, mp, layers,
n_gpus]` one training step (remat; a full step's Adam moments in `dtype`, LoRA rank 8 with float32 AdamW) laid out as
the `Trainer` lays it out on `n_gpus` GPUs of one host (dp: the rest). Each result is a line `ROW {json}` in GiB per GPU:
XLA's total (arguments + outputs - aliases + temporaries), `plan`'s, and their ratio.

meshtx chooses some kernels by backend (the CPU's weights-first products, its float32 KV cache). Here JAX's default
backend is the CPU: `meshtx.compiled.compiled_memory` traces the target's kernels (`meshtx.model.compiling_for`)."""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")                 # no GPU here: the CPU runs, the CUDA plugin only compiles
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no cuDNN / driver to check
import jax
import meshtx
from tpu_steps import compiled_step, emit
from tpu import prefill_memory

# What XLA:GPU needs to know about each target (its `GpuTargetConfig`, text format); memory as `meshtx.sharding.CHIPS`.
_COMMON = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
               registers_per_core_limit=65536, registers_per_block_limit=65536)
TARGETS = {   # chip: (description, compute capability, SMs, FP32 lanes/SM, shared memory/SM, opt-in/block, threads/SM, L2, GB/s, GHz)
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 2048, 52428800, 3352, 1.98),
    "h200": ("NVIDIA H200", (9, 0), 132, 128, 233472, 232448, 2048, 52428800, 4800, 1.98),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 2048, 41943040, 2039, 1.41),
    "l4": ("NVIDIA L4", (8, 9), 58, 128, 102400, 101376, 1536, 50331648, 300, 2.04),
    "t4": ("Tesla T4", (7, 5), 40, 64, 65536, 65536, 1024, 4194304, 320, 1.59),
}


def target_config(chip: str) -> str:
    "The `GpuTargetConfig` text for `chip` (one of TARGETS)."
    from meshtx.sharding import CHIPS
    name, (major, minor), sms, fpus, smem, optin, threads, l2, gbs, ghz = TARGETS[chip]
    info = dict(_COMMON, core_count=sms, fpus_per_core=fpus, shared_memory_per_core=smem, shared_memory_per_block_optin=optin,
                threads_per_core_limit=threads, l2_cache_size=l2, memory_bandwidth=gbs * 10**9, clock_rate_ghz=ghz,
                device_memory_size=int(CHIPS[chip]))
    body = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\n'
            f'runtime_version {{ major: 12 minor: 8 }}\ndevice_description_str: "{name}"\n')


def gpus(chip: str, n: int):
    "`n` deviceless `chip` GPUs on one host."
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="cuda", target_config=target_config(chip), topology=f"1x1x{n}").devices


def row(chip: str, r: list):
    kind, name, *rest = r
    t0 = time.time()
    try:
        if kind == "infer":
            B, prompt, slots = rest
            cfg = meshtx.ModelConfig.preset(name).replace(param_dtype="bfloat16", compute_dtype="bfloat16")
            m = prefill_memory(cfg, B, prompt, slots, device=gpus(chip, 1)[0])
            pl = meshtx.plan(cfg, 1, mode="infer", batch=B, seq=slots, prompt=prompt, device=chip, param_dtype="bfloat16")
            emit(chip=chip, kind=kind, name=name, B=B, prompt=prompt, slots=slots, xla=m["total"] / 2**30,
                 temps=m["temporaries"] / 2**30, args=m["arguments"] / 2**30, plan=pl.total / 2**30,
                 plan_over_xla=pl.total / m["total"], parts={k: round(v / 2**30, 3) for k, v in pl.bytes.items() if v},
                 s=round(time.time() - t0, 1))
        else:
            B, T, dtype, fsdp, mp, layers, n = rest
            cfg = meshtx.ModelConfig.preset(name).replace(param_dtype=dtype, compute_dtype="bfloat16", remat=True)
            if layers: cfg = cfg.replace(n_layer=layers)
            res = compiled_step(cfg, gpus(chip, n), B, T, dtype, fsdp, mp, 8 if kind == "lora" else 0)
            emit(chip=chip, kind=kind, name=name, B=B, T=T, dtype=dtype, fsdp=fsdp, mp=mp, layers=layers, n=n, **res,
                 s=round(time.time() - t0, 1))
    except Exception as e:
        emit(chip=chip, kind=kind, name=name, row=r, error=f"{type(e).__name__}: {str(e)[:500]}")


if __name__ == "__main__":
    chip = sys.argv[1]
    for r in json.loads(sys.argv[2]): row(chip, r)
