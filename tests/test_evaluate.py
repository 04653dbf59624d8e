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


# Checkpoints shaped like other families' (tiny, random, float32), each with a BPE tokenizer trained here on a few lines:
# Llama-2's (adds `<s>`; here with a chat template) and Qwen2.5-Instruct's (no BOS; `<|im_end|>` ends a text, while
# config.json's bos_token_id is `<|endoftext|>`). MeshtxLM and lm-eval's HFLM load the same directory.
CORPUS = [d["question"] + " " + c + "." for d in QA for c in d["choices"]] + TEXTS + [
    "Hello world, the model runs.", "Question: what is the answer? Answer: the model matches the reference."]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}"
                 "{% if enable_thinking is defined and not enable_thinking %}<nothink> {% endif %}")


def _family_checkpoint(path, family):
    import torch, transformers
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders, processors
    transformers.logging.set_verbosity_error()
    llama = family == "llama"
    specials = ["<unk>", "<s>", "</s>"] if llama else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>") if llama else models.BPE())
    if llama:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else: tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-()\n") if llama
                else pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200 if llama else 400, special_tokens=specials,
                                                        initial_alphabet=alphabet))
    if llama:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>", chat_template=CHAT_TEMPLATE)
    else: hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    shape = dict(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)) if llama else
             transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, bos_token_id=0, eos_token_id=2, tie_word_embeddings=True)))
    with torch.no_grad():
        for p in model.parameters(): p.normal_(0, 0.3)   # sharp distributions: greedy choices are clear
        if llama: model.lm_head.weight[0] *= 3          # and `<unk>`, a special token, is generated now and then
    model.save_pretrained(path); hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    "MeshtxLM and HFLM on one tiny Llama checkpoint whose tokenizer adds `<s>` and has a chat template."
    path = str(_family_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", "llama"))
    return MeshtxLM(pretrained=path, dtype="float32"), HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=1)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    "MeshtxLM and HFLM on one tiny Qwen2 checkpoint whose tokenizer has no BOS (and no chat template)."
    path = str(_family_checkpoint(tmp_path_factory.mktemp("qwen") / "ckpt", "qwen"))
    return MeshtxLM(pretrained=path, dtype="float32"), HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=1)


def _ask(model, kind, *args):
    return getattr(model, kind)([Instance(kind, {}, a, i) for i, a in enumerate(args)], disable_tqdm=True)


def test_a_context_that_starts_with_the_bos_text_gets_no_second_bos(llama):
    "As HFLM: `<s>Hello` (what Llama-2's and Mistral's chat templates make) is encoded with its own `<s>` only."
    ours, theirs = llama
    assert ours.tok_encode("<s>Hello") == theirs.tok_encode("<s>Hello") and ours.tok_encode("<s>Hello").count(1) == 1
    assert ours.tok_encode("Hello")[0] == 1 and ours.tok_encode("Hello", add_special_tokens=False)[0] != 1
    # no two of the same tokens split differently: HFLM (0.4.13) would score those from one forward pass and get the
    # shorter continuation wrong (`<s>Hello`+` world` next to `<s>`+`Hello world`)
    pairs = [("<s>Hello", " world"), ("Hello", " world"), ("<s>", "The model runs.")]
    assert_same(_ask(ours, "loglikelihood", *pairs), _ask(theirs, "loglikelihood", *pairs))
    texts = [("<s>Hello world, the model runs.",), ("Hello world",)]
    assert_same(_ask(ours, "loglikelihood_rolling", *texts), _ask(theirs, "loglikelihood_rolling", *texts))


def test_without_a_bos_the_prefix_token_is_the_tokenizers_eos(qwen):
    "A Qwen2.5-Instruct-shaped tokenizer (no BOS): an empty context and rolling windows start from its EOS, as in HFLM."
    ours, theirs = qwen
    assert ours.tokenizer.bos_token_id is None and ours.lm.config.bos_token_id == 0
    assert ours.prefix_token_id == theirs.prefix_token_id == ours.tokenizer.eos_token_id == 2
    assert_same(_ask(ours, "loglikelihood", ("", "Hello world"), ("Hello", " world")),
                _ask(theirs, "loglikelihood", ("", "Hello world"), ("Hello", " world")))
    texts = [("Hello world, the model runs.",)]
    assert_same(_ask(ours, "loglikelihood_rolling", *texts), _ask(theirs, "loglikelihood_rolling", *texts))
    # HFLM's `prefix_token_id` model argument comes first
    assert MeshtxLM(pretrained=ours.lm, prefix_token_id=0).prefix_token_id == 0


def test_chat_template_matches_hf(llama, qwen, tmp_path):
    "`--apply_chat_template`: the tokenizer's template renders the chat as HFLM's does, and a whole task scores the same."
    ours, theirs = llama
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The capital of France is"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(chat, prompt) == theirs.apply_chat_template(chat, prompt)
    assert ours.apply_chat_template(chat).startswith("<s>[system] Answer briefly.\n")
    assert ours.tokenizer_name == theirs.tokenizer_name and ours.chat_template(True) == theirs.chat_template(True) == CHAT_TEMPLATE
    write_task(tmp_path, "toy_mc", QA[:2], output_type="multiple_choice", doc_to_text="{{question}}",
               doc_to_choice="{{choices}}", doc_to_target="answer", metric_list=[{"metric": "acc"}])
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)   # (not indexing lm-eval's own tasks: 10 s)
    run = lambda model: lm_eval.simple_evaluate(model=model, tasks=["toy_mc"], apply_chat_template=True, log_samples=True,
                                                task_manager=tm)["samples"]["toy_mc"]
    mine, ref = run(ours), run(theirs)
    assert mine[0]["arguments"] == ref[0]["arguments"] and mine[0]["arguments"][0][0].startswith("<s>[user] ")
    assert_same([s["resps"] for s in mine], [s["resps"] for s in ref])
    with pytest.raises(ValueError, match="has no chat template"): qwen[0].apply_chat_template(chat)


def test_generated_text_has_no_special_tokens(llama):
    "As HFLM decodes generations (skip_special_tokens=True): the `<unk>` this model generates is not in the text."
    ours, theirs = llama
    prompt, kw = "Hello world", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    raw = ours.lm.generate([ours.tok_encode(prompt)], max_new_tokens=6, temperature=0)
    assert 0 in raw.tokens[0] and "<unk>" in raw.texts[0]      # the model does generate a special token here
    mine = _ask(ours, "generate_until", (prompt, kw))
    assert mine == _ask(theirs, "generate_until", (prompt, kw)) and "<unk>" not in mine[0] and mine[0].strip()


def test_any_number_of_stop_strings(llama):
    "HFLM takes any number of `until` strings; `lm.generate` at most 16 (MAX_STOPS): every one still cuts the text."
    from meshtx.sampling import MAX_STOPS
    ours, theirs = llama
    prompt = "The model"
    tokens = ours.lm.generate([ours.tok_encode(prompt)], max_new_tokens=8, temperature=0).tokens[0]
    free = ours.tokenizer.decode(tokens, skip_special_tokens=True)   # the continuation decoded alone, as HFLM decodes it
    cut = free.split()[1]
    until = [f"\nstop {i}" for i in range(MAX_STOPS + 4)] + [cut]           # the one that matters is the last
    kw = {"until": until, "max_gen_toks": 8, "do_sample": False}
    mine = _ask(ours, "generate_until", (prompt, kw))
    assert mine == _ask(theirs, "generate_until", (prompt, kw)) == [free[:free.index(cut)]], (mine, free)


def test_thinking_options_match_hf(llama):
    "HFLM's options for reasoning models: `enable_thinking` and `chat_template_args` reach the chat template, and "
    "`think_end_token` (a text or a token id) keeps what follows its last occurrence, as HFLM's generations do."
    ours, theirs = llama
    both = lambda **kw: (MeshtxLM(pretrained=ours.lm, **kw),
                         HFLM(pretrained=theirs.pretrained, dtype="float32", device="cpu", batch_size=1, **kw))
    chat = [{"role": "user", "content": "The capital of France is"}]
    for kw in ({"enable_thinking": False}, {"chat_template_args": {"enable_thinking": False}}):
        mine, ref = both(**kw)
        assert mine.apply_chat_template(chat) == ref.apply_chat_template(chat) and mine.apply_chat_template(chat).endswith("<nothink> ")
    assert ours.apply_chat_template(chat).endswith("[assistant] ")   # by default the template's variable is not set
    prompt, gen = "The model", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    tokens = ours.lm.generate([ours.tok_encode(prompt)], max_new_tokens=8, temperature=0).tokens[0]
    word = ours.tokenizer.decode(tokens, skip_special_tokens=True).split()[1]
    for end in (word, int(tokens[3]), str(tokens[3])):
        mine, ref = both(think_end_token=end)
        assert _ask(mine, "generate_until", (prompt, gen)) == _ask(ref, "generate_until", (prompt, gen)), end
    mine, ref = both(enable_thinking=True, think_end_token=word)
    for m in (mine, ref):
        with pytest.raises(ValueError, match="generative tasks"): _ask(m, "loglikelihood", ("Hello", " world"))
