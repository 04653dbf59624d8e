"""`meshtx.evaluate` against lm-eval's own `hf` model on the same float32 weights: whole local tasks, raw
requests, the command line, and perplexity against a direct computation and against torch."""
import json, math, os, subprocess, sys, tempfile
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"            # local files only
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="meshtx-test-datasets-"))
import numpy as np
import pytest
from conftest import assert_same, write_task   # shared by the lm-eval tests: a local task; results compared

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")                   # lm-eval's `hf` model needs it (the dev extra has it)
import jax, yaml
import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from meshtx import LM, EOT
from meshtx.evaluate import MeshtxLM, perplexity

QA = [{"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
      {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
      {"question": "The opposite of hot is", "choices": ["cold", "warm", "red"], "answer": 0},
      {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit", "Kelvin"], "answer": 0}]
TEXTS = [d["question"] + " " + d["choices"][d["answer"]] + ". " + "It is known; everybody says so. " * (i + 1)
         for i, d in enumerate(QA)]
TASKS = ["toy_mc", "toy_ppl", "toy_gen"]
GEN_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    "The random `demo` model saved as a Hugging Face checkpoint, and three local tasks over it."
    root = tmp_path_factory.mktemp("eval")
    lm = LM.init("demo")
    lm.save_hf(root / "ckpt", progress=False)
    tasks = root / "tasks"; tasks.mkdir()
    write_task(tasks, "toy_mc", QA, output_type="multiple_choice", doc_to_text="{{question}}",
               doc_to_choice="{{choices}}", doc_to_target="answer", metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])
    write_task(tasks, "toy_ppl", [{"text": t} for t in TEXTS], output_type="loglikelihood_rolling", doc_to_text="",
               doc_to_target="{{text}}", metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")])
    # stop strings the random model really produces: a whole word, and a piece of a token (cut as text)
    free = lm.generate([d["question"] for d in QA], max_new_tokens=GEN_TOKENS, temperature=0).texts
    stops = [" " + free[1].split()[2], free[2][6:9]]
    write_task(tasks, "toy_gen", QA, output_type="generate_until", doc_to_text="{{question}}",
               doc_to_target="{{choices[answer]}}", generation_kwargs={"until": stops, "max_gen_toks": GEN_TOKENS},
               metric_list=[{"metric": "exact_match"}])
    return dict(root=root, ckpt=root / "ckpt", tasks=tasks, lm=lm, free=free, stops=stops)


def hf_model(setup, **kw):
    return HFLM(pretrained=str(setup["ckpt"]), dtype="float32", device="cpu", batch_size=1, **kw)


def evaluate(model, setup, tasks=TASKS, **kw):
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=TaskManager(include_path=str(setup["tasks"])),
                                   log_samples=True, **kw)


@pytest.mark.slow
def test_local_tasks_match_hf(setup):
    ours = evaluate(MeshtxLM(pretrained=str(setup["ckpt"]), dtype="float32", batch_size=4), setup)
    theirs = evaluate(hf_model(setup), setup)
    for task in TASKS:
        mine, ref = ours["results"][task], theirs["results"][task]
        metrics = [k for k, v in ref.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        assert len(metrics) >= 2, ref
        for k in metrics: assert_same(mine[k], ref[k])
        for a, b in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert_same(a["resps"], b["resps"])
    # the generation stopped at the task's stop strings (both models): at least one text was cut short
    gen = [s["resps"][0][0] for s in ours["samples"]["toy_gen"]]
    assert any(len(g) < len(f) for g, f in zip(gen, setup["free"])), (gen, setup["free"])
    assert all(f.startswith(g) for g, f in zip(gen, setup["free"]))


@pytest.mark.slow
def test_raw_requests_match_hf(setup):
    "Log-likelihoods with HFLM's tokenization, empty context, left truncation, is_greedy, and rolling windows."
    lm = setup["lm"]
    greedy = lm.tokenizer.decode(int(np.asarray(lm.logits("Hello there")[0, -1]).argmax()))
    long = " ".join(TEXTS)
    pairs = [("The capital of France is", " Paris"), ("", "Hello world"), ("Two plus two equals ", "four"),
             ("Hello there", greedy), (long, " and so on, forever."), ("x", " y" * 15)]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([TEXTS[0], long, ""])]
    ours, theirs = MeshtxLM(pretrained=str(setup["ckpt"]), dtype="float32", max_length=16), hf_model(setup, max_length=16)
    mine, ref = ours.loglikelihood(reqs, disable_tqdm=True), theirs.loglikelihood(reqs, disable_tqdm=True)
    assert_same(mine, ref)
    assert mine[3][1] is True and not all(g for _, g in mine)
    assert_same(ours.loglikelihood_rolling(rolling, disable_tqdm=True), theirs.loglikelihood_rolling(rolling, disable_tqdm=True))
    # and the windowed perplexity is the rolling log-likelihood, per token
    n = len(lm.tokenizer(long).input_ids)
    ppl = math.exp(-theirs.loglikelihood_rolling(rolling[1:2], disable_tqdm=True)[0] / n)
    assert abs(perplexity(lm, long, max_length=16) - ppl) <= 1e-4 * ppl


@pytest.mark.slow
def test_command_line(setup, tmp_path):
    "`meshtx eval` (= `python -m meshtx.evaluate`) is `lm_eval` with the `meshtx` model registered."
    out = tmp_path / "out"
    exe = os.path.join(os.path.dirname(sys.executable), "meshtx")
    r = subprocess.run([exe, "eval", "--model", "meshtx",
                        "--model_args", f"pretrained={setup['ckpt']},dtype=float32", "--batch_size", "2",
                        "--tasks", "toy_mc", "--include_path", str(setup["tasks"]), "--limit", "2",
                        "--output_path", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "toy_mc" in r.stdout
    result, = out.rglob("results_*.json")
    acc = json.loads(result.read_text())["results"]["toy_mc"]["acc,none"]
    ref = evaluate(hf_model(setup), setup, tasks=["toy_mc"], limit=2)["results"]["toy_mc"]["acc,none"]
    assert acc == ref


def test_perplexity(setup):
    "exp(mean NLL) with `<|endoftext|>` in front: from meshtx's logits directly, and from torch on the same weights."
    import torch, transformers
    lm, text = setup["lm"], TEXTS[1]
    ids = [EOT] + lm.tokenizer(text).input_ids
    lp = jax.nn.log_softmax(lm.logits(ids[:-1])[0], axis=-1)
    direct = math.exp(-float(np.mean([lp[i, t] for i, t in enumerate(ids[1:])])))
    ppl = perplexity(lm, text)
    assert abs(ppl - direct) <= 1e-4 * direct
    hf = transformers.GPTJForCausalLM.from_pretrained(setup["ckpt"], dtype=torch.float32).eval()
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    ref = math.exp(float(loss))
    assert abs(ppl - ref) <= 1e-4 * ref, (ppl, ref)
    # several texts: the perplexity of all their tokens together
    both = perplexity(lm, TEXTS[:2])
    n = [len(lm.tokenizer(t).input_ids) for t in TEXTS[:2]]
    logs = [math.log(perplexity(lm, t)) for t in TEXTS[:2]]
    assert abs(math.log(both) - (n[0] * logs[0] + n[1] * logs[1]) / sum(n)) < 1e-5


def _run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["MESHTX_CACHE_DIR"] = "off"
    return subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=timeout, env=env)


def test_python_m_meshtx_evaluate_runs_without_a_runtime_warning():
    "`python -m meshtx.evaluate` is lm_eval's command line, with no runpy warning that the module was imported twice."
    r = _run(sys.executable, "-m", "meshtx.evaluate", "--help")
    assert r.returncode == 0 and "lm-eval" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "RuntimeWarning" not in r.stderr and "found in sys.modules" not in r.stderr, r.stderr


def test_eval_help_says_how_to_reach_the_meshtx_model():
    "`meshtx eval --help`: examples with `--model meshtx`, and why lm-eval's own `lm_eval --model meshtx` may not see it."
    r = _run(os.path.join(os.path.dirname(sys.executable), "meshtx"), "eval", "--help")
    assert r.returncode == 0, r.stderr
    examples = [l.strip() for l in r.stdout.splitlines() if l.startswith("  ")]
    assert sum(e.startswith("meshtx eval --model meshtx --model_args pretrained=") for e in examples) >= 2, examples
    assert any(e.startswith("python -m meshtx.evaluate --model meshtx ") for e in examples), examples
    text = " ".join(r.stdout.split())
    assert "Why not `lm_eval --model meshtx`?" in text and "registered in its own process" in text, text
    assert "`lm_eval.models` entry point" in text and 'simple_evaluate(model="meshtx"' in text, text


def test_meshtx_is_an_lm_eval_models_entry_point():
    "The installed distribution declares `meshtx` in lm-eval's plugin group (`lm_eval.models`), naming MeshtxLM."
    from importlib.metadata import entry_points
    eps = {ep.name: ep for ep in entry_points(group="lm_eval.models")}
    assert "meshtx" in eps, f"no lm_eval.models entry point (reinstall: pip install -e .): {sorted(eps)}"
    assert eps["meshtx"].value == "meshtx.evaluate:MeshtxLM" and eps["meshtx"].load() is MeshtxLM


# lm-eval's own command line, as a plugin-reading lm-eval runs it: the entry point recorded as a placeholder in its
# model registry (without importing meshtx), loaded when `--model meshtx` asks for it
AS_PLUGIN = """import sys, lm_eval.models
from importlib.metadata import entry_points
from lm_eval.api.registry import model_registry
if "meshtx" not in model_registry:
    model_registry.register("meshtx", target=next(e for e in entry_points(group="lm_eval.models") if e.name == "meshtx"))
assert "meshtx" not in sys.modules
from lm_eval.__main__ import cli_evaluate
sys.argv = ["lm_eval", *sys.argv[1:]]
cli_evaluate()"""


@pytest.mark.slow
def test_lm_eval_command_finds_meshtx_through_its_entry_point(setup, tmp_path):
    """`lm_eval --model meshtx` on a local task: the `lm_eval` script itself where the installed lm-eval reads plugins'
    entry points; else (0.4.13 and older) lm-eval's command line after recording the entry point as such an lm-eval does."""
    probe = _run(sys.executable, "-c", "from lm_eval.api.registry import get_model; print(get_model('meshtx').__module__)")
    command = ([os.path.join(os.path.dirname(sys.executable), "lm_eval")] if probe.returncode == 0 else
               [sys.executable, "-c", AS_PLUGIN])
    out = tmp_path / "out"
    r = _run(*command, "--model", "meshtx", "--model_args", f"pretrained={setup['ckpt']},dtype=float32", "--tasks", "toy_mc",
             "--include_path", setup["tasks"], "--limit", 2, "--output_path", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result, = out.rglob("results_*.json")
    acc = json.loads(result.read_text())["results"]["toy_mc"]["acc,none"]
    ref = evaluate(MeshtxLM(pretrained=str(setup["ckpt"]), dtype="float32"), setup, tasks=["toy_mc"], limit=2)
    assert acc == ref["results"]["toy_mc"]["acc,none"]
