"""Serving under load: `meshtx serve` in a subprocess on 127.0.0.1, and `--clients` concurrent clients sending it
a seeded mix of requests to `/v1/completions` for `--seconds` seconds.

The mix (prompt tokens, new tokens; prompt lengths scaled to the model's context, new tokens cut to fit it):
short (16, 3), medium (64, 32), long (32, 200) and long-prompt (384, 16), a quarter of each streamed
(`stream: true`, read to the end). Every request samples (temperature 1) with its own seed, from token ids, so
any preset works, with or without a tokenizer. A client refused with a 503 waits `--backoff` s before its next
request; clients stop sending at the deadline and finish the request they are in.

Before the load: a warm-up, so that compilations are not timed (each kind streamed, and plain in bursts of 1, 2,
4, ... requests up to the server's max batch, then `--warmup-seconds` of the same load, not counted), and a
head-of-line probe: a 3-token request sent while a 200-token one runs, on an otherwise idle server. During the
whole run the server's RSS is read from /proc/PID/status (the peak is VmHWM, the warm-up's included).

`--rev REV` (repeatable) serves the code of another commit, checked out with `git worktree add` into a temporary
directory (removed afterwards) and imported through PYTHONPATH; `--rev .` is the working tree (the default).
One table, a column per rev, to paste into bench/RESULTS.md. Only the standard library runs in this process."""
from __future__ import annotations
import argparse, http.client, json, math, os, platform, random, shutil, signal, subprocess, sys, tempfile, threading, time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# name, prompt tokens (at n_ctx 512), new tokens, share of the requests
KINDS = [("short", 16, 3, 0.35), ("medium", 64, 32, 0.35), ("long", 32, 200, 0.15), ("long-prompt", 384, 16, 0.15)]
STREAM_SHARE = 0.25
VOCAB = 256   # prompt token ids are drawn from [0, VOCAB): inside every preset's vocabulary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", help="the random model the server serves (default demo)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--seconds", type=float, default=50, help="how long the clients send requests (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (and of the requests' sampling)")
    p.add_argument("--rev", action="append", help="serve this commit's code (repeatable: a column each); "
                   "'.' is the working tree (default)")
    p.add_argument("--backoff", type=float, default=1.0, help="seconds a client waits after a 503 (default 1)")
    p.add_argument("--warmup-seconds", type=float, default=10, help="after the warm-up's fixed requests, this long "
                   "of the same load, not counted (default 10); -1: no warm-up at all (compilations timed)")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for the server to answer")
    p.add_argument("--json", help="append the results (one JSON line per rev) to this file")
    for flag in ("--max-batch", "--max-queue", "--batch-wait-ms", "--dtype", "--init-seed"):   # passed to the server
        p.add_argument(flag, help=f"passed to `meshtx serve {flag}` (default: the server's)")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0: p.error("--clients and --seconds must be positive")
    return args


# ---------------------------------------------------------------------------------------------------- the server
def git(*cmd, cwd=REPO) -> str:
    return subprocess.run(["git", *cmd], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def describe(rev: str) -> str:
    "A short name for a column: the commit, and whether the working tree differs from it."
    try:
        if rev != ".": return git("rev-parse", "--short", rev)
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "meshtx")
        return f"{head}+changes" if dirty else head
    except (OSError, subprocess.CalledProcessError): return rev


def _die_with_parent():
    "In the server's process (Linux): SIGKILL when this benchmark dies, even by SIGKILL, so that no server is left."
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError): pass


class Server:
    "`meshtx serve` in a subprocess on 127.0.0.1 (the code of `tree`), its port, its output and its RSS."
    def __init__(self, tree: Path, args):
        cmd = [sys.executable, "-m", "meshtx", "serve", "--preset", args.preset, "--host", HOST, "--port", "0", "-q"]
        for flag in ("max_batch", "max_queue", "batch_wait_ms", "dtype", "init_seed"):
            if getattr(args, flag) is not None: cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "PYTHONUNBUFFERED": "1"}
        check = subprocess.run([sys.executable, "-c", "import meshtx; print(meshtx.__file__)"], env=env, cwd=tree,
                               capture_output=True, text=True)
        if not check.stdout.strip().startswith(str(tree)):
            raise RuntimeError(f"meshtx would not be imported from {tree}: {check.stdout.strip() or check.stderr[-2000:]}")
        self.tail, self.url, self.rss, self.hwm = [], None, [], 0
        self._announced = threading.Event()
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _read(self):   # drain the server's output: the announced address, and the last lines for error messages
        for line in self.proc.stdout:
            self.tail = (self.tail + [line.rstrip()])[-40:]
            if self.url is None and "meshtx: serving" in line and " on http://" in line:
                self.url = line.rsplit(" on http://", 1)[1].strip()
                self._announced.set()
        self._announced.set()

    def _status(self) -> dict:
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"): out[k] = int(v.split()[0]) * 1024
        return out

    def _sample(self):
        while self.proc.poll() is None:
            try: s = self._status()
            except OSError: break
            if "VmRSS" in s: self.rss.append((time.monotonic(), s["VmRSS"]))
            self.hwm = max(self.hwm, s.get("VmHWM", 0))
            time.sleep(0.2)

    def peak_rss(self) -> int:
        try: self.hwm = max(self.hwm, self._status().get("VmHWM", 0))
        except OSError: pass
        return self.hwm

    def rss_now(self) -> int:
        try: return self._status()["VmRSS"]
        except (OSError, KeyError): return self.rss[-1][1] if self.rss else 0

    def output(self) -> str: return "\n".join(self.tail)

    def wait_ready(self, timeout: float) -> int:
        "The port, once the server has announced it and `/v1/models` answers; the model's context length is kept."
        t_end = time.monotonic() + timeout
        if not self._announced.wait(timeout) or self.url is None:
            raise RuntimeError(f"the server did not announce its address (exit code {self.proc.poll()}):\n{self.output()}")
        host, port = self.url.rsplit(":", 1)
        if host != HOST: raise RuntimeError(f"the server listens on {host}, not {HOST}")
        self.port = int(port)
        while True:
            try:
                status, body = request(self.port, "GET", "/v1/models", timeout=10)
                if status == 200:
                    self.n_ctx = json.loads(body)["data"][0].get("max_model_len", 512)
                    return self.port
            except (OSError, http.client.HTTPException): pass
            if self.proc.poll() is not None or time.monotonic() > t_end:
                raise RuntimeError(f"the server did not answer /v1/models (exit code {self.proc.poll()}):\n{self.output()}")
            time.sleep(0.2)

    def stop(self):
        "SIGINT (queued requests answered with a 503, the running batch finishes), again after 10 s, then SIGKILL."
        for sig, wait in ((signal.SIGINT, 10), (signal.SIGINT, 5), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None: break
            try: self.proc.send_signal(sig)
            except ProcessLookupError: break
            try: self.proc.wait(wait)
            except subprocess.TimeoutExpired: pass


class Checkout:
    "The tree to serve: the working tree for '.', else `git worktree add` of `rev` into a temporary directory."
    def __init__(self, rev: str): self.rev, self.tmp = rev, None

    def __enter__(self) -> Path:
        if self.rev == ".": return REPO
        self.tmp = Path(tempfile.mkdtemp(prefix="meshtx-bench-serve-"))
        try: git("worktree", "add", "--detach", "--quiet", str(self.tmp / "tree"), self.rev)
        except BaseException: self.__exit__(); raise
        return self.tmp / "tree"

    def __exit__(self, *exc):
        if self.tmp is None: return
        try: git("worktree", "remove", "--force", str(self.tmp / "tree"))
        except (OSError, subprocess.CalledProcessError): pass
        shutil.rmtree(self.tmp, ignore_errors=True)
        try: git("worktree", "prune")
        except (OSError, subprocess.CalledProcessError): pass


# ---------------------------------------------------------------------------------------------------- the clients
def request(port, method, path, body=None, timeout=600.0):
    "(status, body bytes) of one plain request."
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json"} if body is not None else {})
        r = c.getresponse()
        return r.status, r.read()
    finally: c.close()


def kinds(n_ctx: int) -> list[tuple]:
    "The mix at this context length: (name, prompt tokens, new tokens, share)."
    out = []
    for name, prompt, new, share in KINDS:
        prompt = max(1, min(prompt * n_ctx // 512, n_ctx - 2))
        out.append((name, prompt, max(1, min(new, n_ctx - prompt - 1)), share))
    return out


def completion(rng: random.Random, mix, kind=None, stream=None) -> dict:
    "One request of the mix (of `kind`, streamed or not, if given), with its own prompt and seed."
    if kind is None: kind = rng.choices(mix, weights=[m[3] for m in mix])[0]
    else: kind = next(m for m in mix if m[0] == kind)
    name, prompt, new, _ = kind
    stream = rng.random() < STREAM_SHARE if stream is None else stream
    body = {"prompt": [rng.randrange(VOCAB) for _ in range(prompt)], "max_tokens": new, "temperature": 1.0,
            "seed": rng.randrange(2**32)}
    if stream: body.update(stream=True, stream_options={"include_usage": True})
    return dict(kind=name, stream=stream, body=body)


def send(port, req: dict, timeout=600.0) -> dict:
    """Send one request of `completion` (on a new connection): status, latency (s), time to the first text
    (streams), completion tokens, and an error message if it failed."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    out = dict(kind=req["kind"], stream=req["stream"], status=None, latency=None, ttft=None, tokens=0, error=None)
    t0 = time.perf_counter()
    try:
        c.request("POST", "/v1/completions", body=json.dumps(req["body"]), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200 or not req["stream"]:
            data = r.read()
            if r.status == 200: out["tokens"] = json.loads(data)["usage"]["completion_tokens"]
            else: out["error"] = data[:300].decode(errors="replace")
        else:   # server-sent events, read to `[DONE]`
            chunks, usage = 0, None
            while line := r.readline():
                line = line.strip()
                if not line.startswith(b"data:"): continue
                data = line[5:].strip()
                if data == b"[DONE]": break
                event = json.loads(data)
                if "error" in event: out["error"] = event["error"].get("message", "error event"); continue
                if event.get("usage"): usage = event["usage"]["completion_tokens"]
                if any(ch.get("finish_reason") is None for ch in event.get("choices", [])):   # text (maybe "": no tokenizer)
                    chunks += 1
                    if out["ttft"] is None: out["ttft"] = time.perf_counter() - t0
            r.read()
            out["tokens"] = usage if usage is not None else chunks   # without a usage chunk: chunks, not tokens
        out["latency"] = time.perf_counter() - t0
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally: c.close()
    return out


def client(port, rng, mix, deadline, backoff, results, lock):
    while time.perf_counter() < deadline:
        r = send(port, completion(rng, mix))
        r["end"] = time.perf_counter()
        with lock: results.append(r)
        if r["status"] == 503: time.sleep(backoff * (0.5 + rng.random()))
        elif r["status"] is None: time.sleep(0.1)


def burst(port, reqs: list) -> list[dict]:
    "Send `reqs` at once (each from its own thread): their results."
    out = [None] * len(reqs)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, send(port, r))) for i, r in enumerate(reqs)]
    for t in threads: t.start()
    for t in threads: t.join()
    return out


def warm_up(port, mix, clients: int, max_batch: int, rng) -> None:
    """Compile what the load will run, untimed: each kind streamed, and each kind plain in bursts of 1, 2, 4, ...
    requests up to `max_batch` (the batch sizes `generate` compiles for); mixed batches come in `--warmup-seconds`."""
    for name, *_ in mix:
        r = send(port, completion(rng, mix, name, True))
        if r["status"] != 200 or r["error"]: raise RuntimeError(f"warm-up request ({name}, streamed) failed: {r}")
        b = 1
        while b <= min(clients, max_batch):
            for r in burst(port, [completion(rng, mix, name, False) for _ in range(b)]):
                if r["status"] != 503 and (r["status"] != 200 or r["error"]):   # a 503: a queue shorter than the burst
                    raise RuntimeError(f"warm-up request ({name}) failed: {r}")
            b *= 2


def head_of_line(port, mix, rng) -> dict:
    "A short request sent while a long one runs (idle server otherwise): both latencies, and the short one alone."
    long, short = next(m for m in mix if m[0] == "long"), next(m for m in mix if m[0] == "short")
    alone = send(port, completion(rng, mix, "short", False))["latency"]
    got = {}
    t = threading.Thread(target=lambda: got.update(long=send(port, completion(rng, mix, "long", False))))
    t.start()
    t_end = time.perf_counter() + 5   # until the long one runs (`/stats`' busy; older servers: a fixed 0.5 s)
    time.sleep(0.1)
    while time.perf_counter() < t_end:
        try:
            status, body = request(port, "GET", "/stats", timeout=5)
            if status != 200: time.sleep(0.4); break
            if json.loads(body).get("busy"): break
        except (OSError, http.client.HTTPException, ValueError): time.sleep(0.4); break
        time.sleep(0.02)
    got["short"] = send(port, completion(rng, mix, "short", False))
    t.join()
    return dict(short=got["short"]["latency"], long=got["long"]["latency"], alone=alone,
                short_tokens=short[2], long_tokens=long[2])


# ---------------------------------------------------------------------------------------------------- one rev
def percentile(xs, q):
    "Nearest-rank percentile; None for no values."
    xs = sorted(x for x in xs if x is not None)
    if not xs: return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def load(port, mix, args, seconds: float, seed: int) -> tuple[list[dict], float, int]:
    "`args.clients` clients for `seconds`: their results, the seconds until the last answer, clients unfinished."
    results, lock = [], threading.Lock()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    threads = [threading.Thread(target=client, daemon=True, args=(port, random.Random(seed * 1_000_003 + 1 + i), mix,
                                                                 deadline, args.backoff, results, lock))
               for i in range(args.clients)]
    for t in threads: t.start()
    drain_end = deadline + max(60.0, 2 * seconds)   # the requests in flight at the deadline, bounded too
    for t in threads: t.join(max(0.0, drain_end - time.perf_counter()))
    with lock: done = list(results)
    return done, max([r["end"] for r in done] + [deadline]) - t0, sum(t.is_alive() for t in threads)


def measure(tree: Path, args) -> dict:
    server = Server(tree, args)
    try:
        t_start = time.perf_counter()
        port = server.wait_ready(args.startup_timeout)
        startup = time.perf_counter() - t_start
        mix = kinds(server.n_ctx)
        rng = random.Random(args.seed)
        max_batch = int(args.max_batch or 8)
        try: max_batch = json.loads(request(port, "GET", "/stats", timeout=10)[1]).get("max_batch", max_batch)
        except (OSError, http.client.HTTPException, ValueError): pass   # a server without /stats
        t_warm = time.perf_counter()
        if args.warmup_seconds >= 0:
            warm_up(port, mix, args.clients, max_batch, rng)
            if args.warmup_seconds > 0: load(port, mix, args, args.warmup_seconds, args.seed + 1)
        warm = time.perf_counter() - t_warm if args.warmup_seconds >= 0 else None
        hol = head_of_line(port, mix, rng)
        idle_rss = server.rss_now()
        done, elapsed, unfinished = load(port, mix, args, args.seconds, args.seed)
        peak = server.peak_rss()
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited during the run ({server.proc.returncode}):\n{server.output()}")
    finally:
        server.stop()
    ok = [r for r in done if r["status"] == 200 and not r["error"]]
    refused = [r for r in done if r["status"] == 503]
    errors = [r for r in done if not (r["status"] == 200 and not r["error"]) and r["status"] != 503]
    lat = [r["latency"] for r in ok]
    by_kind = {name: percentile([r["latency"] for r in ok if r["kind"] == name], 50) for name, *_ in mix}
    return dict(requests=len(done), answered=len(ok), refused=len(refused), errors=len(errors), unfinished=unfinished,
                error_examples=sorted({(r["status"], (r["error"] or "")[:120]) for r in errors})[:3],
                streamed=sum(r["stream"] for r in ok), tokens=sum(r["tokens"] for r in ok), elapsed=elapsed,
                p50=percentile(lat, 50), p99=percentile(lat, 99), by_kind=by_kind,
                ttft50=percentile([r["ttft"] for r in ok if r["stream"]], 50),
                ttft99=percentile([r["ttft"] for r in ok if r["stream"]], 99),
                hol=hol, idle_rss=idle_rss, peak_rss=peak, startup=startup, warmup=warm, mix=mix)


# ---------------------------------------------------------------------------------------------------- the table
def rows(m: dict) -> list[tuple[str, str]]:
    s = lambda v: "—" if v is None else f"{v:.2f} s"
    gb = lambda b: f"{b / 2**30:.2f} GB"
    n = m["requests"] or 1
    hol = m["hol"]
    out = [("requests answered (of them streamed)", f"{m['answered']} ({m['streamed']})"),
           ("refused with 503 (share of all requests)", f"{m['refused']} ({m['refused'] / n:.0%})"),
           ("other errors (share)", f"{m['errors']} ({m['errors'] / n:.0%})"
            + (f"; {m['unfinished']} clients unfinished" if m["unfinished"] else "")),
           ("throughput, completion tok/s (answered requests)", f"{m['tokens'] / m['elapsed']:,.1f} tok/s"),
           ("answered requests / s", f"{m['answered'] / m['elapsed']:.2f}"),
           ("latency p50 / p99", f"{s(m['p50'])} / {s(m['p99'])}")]
    out += [(f"latency p50, {name} ({p} prompt + {new} new tokens)", s(m["by_kind"][name])) for name, p, new, _ in m["mix"]]
    out += [("streams: time to first token p50 / p99", f"{s(m['ttft50'])} / {s(m['ttft99'])}"),
            (f"head of line: {hol['short_tokens']}-token request sent while a {hol['long_tokens']}-token one runs "
             f"(short / long; short alone)", f"{s(hol['short'])} / {s(hol['long'])}; {s(hol['alone'])}"),
            ("server RSS idle (after warm-up) / peak (VmHWM)", f"{gb(m['idle_rss'])} / {gb(m['peak_rss'])}"),
            ("server start / warm-up", f"{s(m['startup'])} / {s(m['warmup'])}")]
    return out


def main(argv=None):
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():   # SIGTERM too stops the server and removes the checkout
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    revs = args.rev or ["."]
    names, measured, failed = [], [], []
    for rev in revs:
        name = describe(rev)
        print(f"(serving {name}: {args.clients} clients for {args.seconds:g} s ...)", flush=True)
        try:
            with Checkout(rev) as tree: m = measure(tree, args)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:   # the next rev still runs
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else e
            print(f"({name}: not measured: {detail})", flush=True)
            failed.append(name); continue
        names.append(name); measured.append(m)
        for status, err in m["error_examples"]: print(f"({name}: an error: {status} {err})")
    if measured: table(names, measured, args)
    if failed: sys.exit(f"not measured: {', '.join(failed)}")
    return measured


def table(names, measured, args):
    passed = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                      if k in ("max_batch", "max_queue", "batch_wait_ms", "dtype", "init_seed") and v is not None)
    print(f"\n### serve — preset {args.preset}, {args.clients} clients, {args.seconds:g} s, seed {args.seed}"
          f"{', server: ' + passed if passed else ''} · {time.strftime('%Y-%m-%d')} · "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print("| figure | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    cells = [rows(m) for m in measured]
    for i, (figure, _) in enumerate(cells[0]):
        print(f"| {figure} | " + " | ".join(c[i][1] for c in cells) + " |")
    mix = ", ".join(f"{name} {p}+{new} ({share:.0%})" for name, p, new, share in measured[0]["mix"])
    print(f"(the mix, prompt + new tokens: {mix}; {STREAM_SHARE:.0%} streamed; temperature 1, a seed each; "
          f"after a 503 a client waits ~{args.backoff:g} s; throughput and requests/s over "
          + ", ".join(f"{m['elapsed']:.1f} s" for m in measured) + " (until the last answer); time to first token: "
          "to the first text chunk, none without a tokenizer)")
    if args.json:
        with open(args.json, "a") as f:
            for name, m in zip(names, measured):
                f.write(json.dumps({"bench": "serve", "rev": name, "preset": args.preset, "clients": args.clients,
                                    "seconds": args.seconds, "date": time.strftime("%Y-%m-%d"),
                                    **{k: v for k, v in m.items() if k != "error_examples"}}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__": main()
