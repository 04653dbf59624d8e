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


def child(args, cache, dtype):
    code = CHILD.format(bench=str(Path(__file__).parent), cache=cache, preset=args.preset, dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parser(__doc__).parse_args(argv)
    from common import default_dtype
    dtype = default_dtype(args)
    with tempfile.TemporaryDirectory() as cache:
        cold, warm = child(args, cache, dtype), child(args, cache, dtype)
    rows = [dict(figure=f"first {k.replace('_', ' ')}, new cache", meshtx=cold[k], unit="s", lower_is_better=True) for k in cold]
    rows += [dict(figure=f"first {k.replace('_', ' ')}, second process (cache)", meshtx=warm[k], unit="s", lower_is_better=True)
             for k in warm]
    report("compile", rows, args, "(time from a built model to the first result; includes tracing and compiling)")
    return rows


if __name__ == "__main__": main()
