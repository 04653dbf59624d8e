"""Compile time: a fresh process builds the model and runs its first forward and train step (dominated by XLA
compilation); a second process with the same persistent compilation cache does it again. HF has no compile step."""
import json, os, subprocess, sys, tempfile
from pathlib import Path
from common import parser, report

CHILD = r'''
import sys, time, json, itertools, numpy as np
t0 = time.perf_counter()
sys.path.insert(0, {bench!r})
from common import PRESETS
from meshtx import LM, ModelConfig, enable_compilation_cache
from meshtx.train import Trainer
enable_compilation_cache({cache!r})
cfg = ModelConfig(**PRESETS[{preset!r}])
lm = LM.init(cfg, dtype={dtype!r}, tokenizer=None)
t1 = time.perf_counter()
tokens = np.zeros((1, 2, 65), np.int32)
lm.logits(tokens[0, :, :-1]).block_until_ready()
t2 = time.perf_counter()
Trainer(lm, itertools.repeat(tokens), progress=False).step()
t3 = time.perf_counter()
print(json.dumps({{"forward": t2 - t1, "train_step": t3 - t2}}))
'''

# --abstract: compile only, on parameter shapes (nothing allocated), so any preset compiles on any machine
CHILD_ABSTRACT = r'''
import sys, time, json, jax, jax.numpy as jnp
sys.path.insert(0, {bench!r})
from common import PRESETS
from meshtx import ModelConfig, enable_compilation_cache
from meshtx.model import param_shapes, gptj
from meshtx.train import make_optimizer, make_train_step, TrainState
enable_compilation_cache({cache!r})
cfg = ModelConfig(**PRESETS[{preset!r}], param_dtype={dtype!r}, compute_dtype={dtype!r}, remat=True)
shapes = param_shapes(cfg)
t0 = time.perf_counter()
jax.jit(gptj(cfg).apply).lower(shapes, jax.ShapeDtypeStruct((1, {seq}), jnp.int32)).compile()
t1 = time.perf_counter()
opt = make_optimizer(mu_dtype={dtype!r})
state = TrainState(shapes, jax.eval_shape(opt.init, shapes), jax.ShapeDtypeStruct((), jnp.int32))
make_train_step(cfg, opt).lower(state, jax.ShapeDtypeStruct((1, 4, {seq} + 1), jnp.int32), {{}}).compile()
t2 = time.perf_counter()
print(json.dumps({{"forward": t1 - t0, "train_step": t2 - t1}}))
'''


def child(args, cache, dtype):
    template = CHILD_ABSTRACT if args.abstract else CHILD
    code = template.format(bench=str(Path(__file__).parent), cache=cache, preset=args.preset, dtype=dtype, seq=args.seq)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--abstract", action="store_true",
                   help="only compile the forward pass (batch 1) and a remat train step (batch 4), on parameter shapes: "
                        "nothing is allocated, so GPT-J-6B's shape compiles on a small machine")
    p.add_argument("--seq", type=int, default=2048, help="sequence length with --abstract")
    args = p.parse_args(argv)
    from common import default_dtype
    dtype = default_dtype(args)
    with tempfile.TemporaryDirectory() as cache:
        cold, warm = child(args, cache, dtype), child(args, cache, dtype)
    what = "compile of the" if args.abstract else "first"
    rows = [dict(figure=f"{what} {k.replace('_', ' ')}, new cache", meshtx=cold[k], unit="s", lower_is_better=True) for k in cold]
    rows += [dict(figure=f"{what} {k.replace('_', ' ')}, second process (cache)", meshtx=warm[k], unit="s", lower_is_better=True)
             for k in warm]
    report("compile", rows, args, f"(compiling only, on parameter shapes: forward at 1 × {args.seq}, remat train step at "
                                  f"4 × {args.seq})" if args.abstract else
                                  "(time from a built model to the first result; includes tracing and compiling)")
    return rows


if __name__ == "__main__": main()
