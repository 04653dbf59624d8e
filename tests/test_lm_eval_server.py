"""lm-eval's own `local-completions` model against `meshtx serve` scores as `meshtx eval` does: the same accuracy and
per-choice log-likelihoods on a multiple-choice task, the same texts on a generation task; local tasks, offline.

lm-eval's `local-completions` (lm_eval/models/openai_completions.py, 0.4.x) sends, to `/v1/completions`:
- per log-likelihood batch: `{"model", "prompt": [[context + continuation token ids], ...], "temperature": 0,
  "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}`, and reads, per choice (sorted by `index`),
  `logprobs.token_logprobs[ctxlen:-1]` (summed) and `logprobs.top_logprobs[ctxlen:-1]` (greedy where a token's
  log-probability equals the largest of its position's top ones): so the answer must hold one entry per prompt token
  (the first one null) *and one for the generated token*, which lm-eval drops;
- per generation batch: `{"prompt": [[context token ids], ...], "model", "max_tokens": max_gen_toks,
  "temperature": 0, "stop": until + ["<|endoftext|>"], "seed": 1234}`, and takes `choices[i].text` as it is."""
import json, os, re, shutil, subprocess, sys, tempfile, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"            # local files only
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="meshtx-test-datasets-"))
import numpy as np
import pytest
from conftest import assert_same, write_task   # shared by the lm-eval tests: a local task; results compared

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")                     # lm-eval's API models need lm-eval[api]
import httpx, requests, yaml
import lm_eval
from lm_eval.tasks import TaskManager
from meshtx import LM
from meshtx.evaluate import MeshtxLM

pytestmark = pytest.mark.timeout(300)
QA = [{"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
      {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
      {"question": "The opposite of hot is", "choices": ["cold", "warm", "red"], "answer": 0}]
TASKS, GEN_TOKENS, BATCH = ["toy_mc", "toy_gen"], 8, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The `demo` model (the weights `meshtx serve --preset demo` serves), its tokenizer saved for lm-eval, and two local
    tasks: multiple choice whose first choice is each question's greedy next token (so `is_greedy` is exercised),
    and generation cut by stop strings the model really produces."""
    root = tmp_path_factory.mktemp("lm-eval-server")
    lm = LM.init("demo")
    lm.tokenizer.save_pretrained(root / "tokenizer")          # tokenizer.json: AutoTokenizer reads it offline
    free = lm.generate([d["question"] for d in QA], max_new_tokens=GEN_TOKENS, temperature=0)
    greedy = [lm.tokenizer.decode(t[:1]) for t in free.tokens]
    rows = [{**d, "choices": [g] + [" " + c for c in d["choices"]]} for d, g in zip(QA, greedy)]
    tasks = root / "tasks"; tasks.mkdir()
    write_task(tasks, "toy_mc", rows, output_type="multiple_choice", doc_to_text="{{question}}", target_delimiter="",
               doc_to_choice="{{choices}}", doc_to_target="answer", metric_list=[{"metric": "acc"}])
    stops = [" " + free.texts[1].split()[2], free.texts[2][6:9]]
    write_task(tasks, "toy_gen", QA, output_type="generate_until", doc_to_text="{{question}}",
               doc_to_target="{{choices[answer]}}", generation_kwargs={"until": stops, "max_gen_toks": GEN_TOKENS},
               metric_list=[{"metric": "exact_match"}])
    return dict(lm=lm, tokenizer=root / "tokenizer", tasks=tasks, stops=stops, free=free.texts,
                task_manager=TaskManager(include_path=str(tasks), include_defaults=False))   # (indexing lm-eval's own: ~10 s)


def evaluate(setup, model, model_args=None):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, log_samples=True,
                                   task_manager=setup["task_manager"])


def local_completions(setup, url):
    "lm-eval's `local-completions` on `url`, tokenizing with the model's own tokenizer (a local copy: offline)."
    args = dict(base_url=f"{url}/v1/completions", model="demo", tokenizer=setup["tokenizer"], tokenizer_backend="huggingface",
                tokenized_requests=True, max_length=512, batch_size=BATCH, max_retries=1)
    return evaluate(setup, "local-completions", ",".join(f"{k}={v}" for k, v in args.items()))


class Recorder(ThreadingHTTPServer):
    "A stand-in for `/v1/completions` on 127.0.0.1 that records each body and answers in the right shape (dummy numbers)."
    def __init__(self):
        self.bodies = []
        recorder = self
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args): pass
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                recorder.bodies.append(body)
                lp = lambda p: {"token_logprobs": [None] + [-1.0] * len(p), "top_logprobs": [None] + [{"x": -1.0}] * len(p)}
                choices = [{"index": i, "text": "", "finish_reason": "length", "logprobs": lp(p) if body.get("echo") else None}
                           for i, p in enumerate(body["prompt"])]
                data = json.dumps({"object": "text_completion", "choices": choices}).encode()
                self.send_response(200); self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


def test_what_local_completions_sends(setup):
    "The requests meshtx serve has to answer, exactly: token-id prompts, batched; echo + logprobs=1 + max_tokens=1 to score."
    rec = Recorder()
    try: local_completions(setup, rec.url)
    finally: rec.shutdown(); rec.server_close()
    tok = setup["lm"].tokenizer
    scored = [b for b in rec.bodies if b.get("echo")]
    assert scored and all(b == {"model": "demo", "prompt": b["prompt"], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                "seed": 1234, "echo": True} for b in scored), scored
    rows = [json.loads(l) for l in (setup["tasks"] / "toy_mc.jsonl").read_text().splitlines()]
    want = sorted(tok(r["question"] + c).input_ids for r in rows for c in r["choices"])
    assert sorted(p for b in scored for p in b["prompt"]) == want
    generated = [b for b in rec.bodies if not b.get("echo")]
    assert len(generated) == 1 and generated[0] == {
        "prompt": sorted((tok(d["question"]).input_ids for d in QA), key=len, reverse=True), "model": "demo",
        "max_tokens": GEN_TOKENS, "temperature": 0, "stop": setup["stops"] + ["<|endoftext|>"], "seed": 1234}
    assert all(1 <= len(b["prompt"]) <= BATCH for b in rec.bodies)


class Server:
    "`meshtx serve --preset demo --port 0 -q` on 127.0.0.1 (one CPU device, as users have); its URL from its first line."
    def __init__(self, log_dir):
        exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.setdefault("MESHTX_CACHE_DIR", "off")
        self.log = Path(log_dir) / "serve.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([exe, "serve", "--preset", "demo", "--port", "0", "-q"], stdout=f,
                                         stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None: pytest.fail(f"meshtx serve exited:\n{self.log.read_text()}")
            m = re.search(r" on (http://127\.0\.0\.1:\d+)\n", self.log.read_text())
            try:
                if m and httpx.get(f"{m.group(1)}/v1/models", timeout=2).status_code == 200: return m.group(1)
            except httpx.HTTPError: pass
            time.sleep(0.25)
        pytest.fail(f"meshtx serve did not answer within {timeout} s:\n{self.log.read_text()}")

    def stop(self):
        self.proc.terminate()
        try: self.proc.wait(20)
        except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait(10)


def test_local_completions_on_meshtx_serve_scores_as_meshtx_eval(setup, tmp_path):
    server = Server(tmp_path)                       # starts while the reference runs
    try:
        ours = evaluate(setup, MeshtxLM(pretrained=setup["lm"], batch_size=BATCH))
        url = server.wait_ready()
        try: theirs = local_completions(setup, url)
        except requests.HTTPError as e:
            pytest.fail(f"meshtx serve refused lm-eval's request: {e.response.status_code} {e.response.text}")
    finally: server.stop()
    for task in TASKS:
        assert ours["results"][task]["sample_len"] == len(QA)
        for k, v in ours["results"][task].items():
            if isinstance(v, float): assert theirs["results"][task][k] == pytest.approx(v, abs=1e-9), (task, k)
        for a, b in zip(theirs["samples"][task], ours["samples"][task], strict=True):
            assert_same(a["resps"], b["resps"])       # each choice's (log-likelihood, is_greedy); each generated text
    mc = [r for s in ours["samples"]["toy_mc"] for r in s["resps"]]
    assert any(g for [(_, g)] in mc) and not all(g for [(_, g)] in mc)   # greedy and not: both paths are checked
    gen = [s["resps"][0][0] for s in ours["samples"]["toy_gen"]]
    assert any(len(g) < len(f) for g, f in zip(gen, setup["free"])) and all(f.startswith(g) for g, f in zip(gen, setup["free"]))
