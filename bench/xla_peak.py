"""Which buffers set a compiled step's peak: read from XLA's dump of it (no JAX needed), phase by phase.

    MESHTX_XLA_DUMP=/tmp/dump bash bench/tpu_plan.sh '[["llama-3.2-1b", "train", 8, 2048, "bfloat16", 8, 1, 0, "v5e:2x4", null]]'
    python bench/xla_peak.py /tmp/dump            # the step's program: its live peak, then each phase's own peak

XLA writes, for each program, its buffer assignment (each value's size and slot), its live ranges (each value's
first and last step of the schedule) and its optimized HLO (each instruction's `op_name`). This adds the sizes of the
values live at each step (values that share a slot count once: an alias, not a second buffer), and groups the steps by
the first three parts of their instruction's `op_name`: `jit(step)/jvp(gptj)/while` is the forward's loops (the
blocks', and the fused loss's), `jit(step)/transpose(jvp(gptj))/while` the blocks' backward. For each phase it prints
its highest point and the largest buffers then live, arguments left out (the weights and moments).

What it cannot see: on a TPU, the memory analysis's temporaries (what `meshtx.compiled.compiled_memory` reports) came
to 0.15-2.7 GiB more than the dump's preallocated temporary buffer (thirty-first session, bench/RESULTS.md), so the
live peak here is not XLA's figure. Nor is it exactly the peak that XLA's live-range file states (printed beside it):
of nine TPU steps read, this count, slot by slot, came within 0.02 GiB of that one at three, above it at five (by up
to 2.1 GiB: a single chip's Llama-3.2-1B full step) and 0.59 GiB under at one. Read it for which buffers are live
together, and how large each is, not for a total."""
import glob, re, sys


def _one(d: str, pattern: str) -> str:
    files = sorted(glob.glob(f"{d}/*{pattern}"))
    if not files: sys.exit(f"{d}: no file *{pattern} (was the program compiled with --xla_dump_to={d}?)")
    return files[0]


def values(d: str, program: str = "jit_step"):
    """{value: (bytes, shape, (allocation, offset), an argument's?)} from the buffer assignment of `program` in dump
    dir `d` (an argument's: its allocation holds one of the program's parameters, the weights and moments)."""
    out, alloc, arg = {}, None, False
    for line in open(_one(d, f"{program}*after_optimizations-buffer-assignment.txt")):
        a = re.match(r"allocation (\d+): size \d+, (parameter)?", line)
        if a: alloc, arg = int(a.group(1)), bool(a.group(2)); continue
        m = re.search(r"value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", line)
        if m: out[m.group(1)] = (int(m.group(2)), m.group(4).split("{")[0], (alloc, int(m.group(3))), arg)
    return out


def live_ranges(d: str, program: str = "jit_step"):
    "The schedule ({step: instruction}) and each value's live range [(value, first, last)]."
    txt = open(_one(d, f"{program}*after_optimizations-live-range.txt")).read()
    head, rest = txt.split("BufferLiveRange:")
    steps = {int(i): n for i, n in re.findall(r"^    (\d+):(\S+)$", head, re.M)}
    ranges = [(n, int(a), int(b)) for n, a, b in re.findall(r"^    (\S+):(\d+)-(\d+)$", rest.split("Live ranges at")[0], re.M)]
    return steps, ranges


def phases(d: str, program: str = "jit_step"):
    "{instruction: its op_name's first three parts}, from the optimized HLO."
    hlo = open(_one(d, f"{program}*after_optimizations.txt")).read()
    return {m.group(1): "/".join(m.group(2).split("/")[:3])
            for m in re.finditer(r"^\s*(?:ROOT )?%?(\S+) = .*?op_name=\"([^\"]*)\"", hlo, re.M)}


def curve(d: str, program: str = "jit_step"):
    "Bytes live at each step of the schedule, the live values [(value, bytes, shape, first, last, an argument's?)] and the schedule."
    size, (steps, ranges) = values(d, program), live_ranges(d, program)
    slots, live = {}, []
    for n, a, b in ranges:
        k = n if n in size else n.removesuffix("{}")
        if k not in size: continue
        s, shape, slot, arg = size[k]
        live.append((k, s, shape, a, b, arg))
        slots.setdefault(slot, []).append((a, b, s))
    delta = [0] * (max(steps) + 3)
    for rs in slots.values():   # values sharing a slot (aliases): the largest one live counts
        prof = {}
        for a, b, s in rs:
            for t in range(a, b + 1): prof[t] = max(prof.get(t, 0), s)
        for t, s in prof.items(): delta[t] += s; delta[t + 1] -= s
    total, out = 0, []
    for x in delta[:-1]: total += x; out.append(total)
    return out, live, steps


def report(d: str, program: str = "jit_step", top: int = 12, n_phases: int = 6) -> str:
    c, live, steps = curve(d, program)
    ops, best = phases(d, program), {}
    for t, n in steps.items():
        ph = ops.get(n, "(no op_name)")
        if ph not in best or c[t] > c[best[ph]]: best[ph] = t
    peak = max(range(len(c)), key=c.__getitem__)
    own = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", open(_one(d, f"{program}*after_optimizations-live-range.txt")).read())
    own = f"; XLA's own live-range file: {int(own.group(1).replace(' ', '')) / 2**30:.3f} GiB" if own else ""
    rows = [f"{program}: live peak {c[peak] / 2**30:.3f} GiB at step {peak} ({steps.get(peak)}){own}"]
    for ph, t in sorted(best.items(), key=lambda kv: -c[kv[1]])[:n_phases]:
        rows.append(f"phase {ph}: {c[t] / 2**30:.3f} GiB at step {t} ({steps[t]})")
        held = sorted((x for x in live if x[3] <= t <= x[4] and not x[5]), key=lambda x: -x[1])
        rows += [f"    {s / 2**20:9.1f} MiB  {shape:28s} {k}" for k, s, shape, *_ in held[:top]]
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) < 2: sys.exit(__doc__)
    print(report(sys.argv[1], *sys.argv[2:3]))
