"""Each family's checkpoint (Llama, Mistral, Qwen2, GPT-NeoX), with its own tokenizer (trained offline with
`tokenizers` on local text) and a chat template, through the faces users meet: text generation and perplexity equal
HF's, `meshtx convert` both ways, a real HTTP server's chat and prompt scores, lm-eval's log-likelihoods equal to its
own HF model's, a LoRA fine-tuning run whose merged model HF loads, and a full fine-tune from the widget, saved and
sampled. `meshtx convert`, `finetune` and `eval` run as processes on every family; `meshtx serve` on the Llama one."""
import math, os, re, shutil, subprocess, sys, threading, time
from pathlib import Path
from types import SimpleNamespace
import numpy as np
import numpy.testing as npt
import pytest
from conftest import hf_logits
from test_families import LLAMA, NEOX, make_hf
from meshtx import LM
from meshtx.config import quiet_transformers

CHAT = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
IDS = dict(bos_token_id=0, eos_token_id=1)
FAMILIES = {"llama": LLAMA.replace(**IDS),
            "mistral": LLAMA.replace(family="mistral", sliding_window=6, **IDS),   # shorter than the prompts: it slides
            # Qwen's embedding has rows past its tokenizer's ids (and transformers' Qwen2Tokenizer adds <|endoftext|>)
            "qwen2": LLAMA.replace(family="qwen2", qkv_bias=True, ln_eps=1e-6, n_vocab=320, **IDS),
            "gpt_neox": NEOX.replace(**IDS)}
CFG = FAMILIES["llama"]
README = Path(__file__).parent.parent / "README.md"


def train_tokenizer(vocab: int):
    "A byte-level BPE of `vocab` tokens, trained on this repository's README, with `<|begin_of_text|>` 0 and `<|end_of_text|>` 1."
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([README.read_text()], trainer)
    return quiet_transformers().PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                       eos_token="<|end_of_text|>", chat_template=CHAT)


def save_checkpoint(d: Path, cfg, seed: int = 3):
    "HF's own class of `cfg`'s family, random, saved with the trained tokenizer: a checkpoint as the hub has them."
    model = make_hf(cfg, seed=seed)
    model.save_pretrained(d)
    tok = train_tokenizer(LLAMA.n_vocab)
    assert len(tok) == LLAMA.n_vocab <= cfg.n_vocab
    tok.save_pretrained(d)
    return model, tok


@pytest.fixture(scope="module", params=list(FAMILIES))
def ckpt(request, tmp_path_factory):
    cfg = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(request.param) / "ckpt"
    model, tok = save_checkpoint(d, cfg)
    return SimpleNamespace(name=request.param, cfg=cfg, dir=d, model=model, tok=tok)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama") / "ckpt"
    model, tok = save_checkpoint(d, CFG)
    return d, model, tok


def test_text_generation_and_perplexity_equal_hf(ckpt):
    import torch
    d, model, tok = ckpt.dir, ckpt.model, ckpt.tok
    lm = LM.from_hf(d, dtype="float32", progress=False)
    assert lm.tokenizer.chat_template == CHAT and lm.document_start == 0
    prompt = "meshtx runs the families"
    ids = tok(prompt).input_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=1)[0, len(ids):].tolist()
    got = lm.generate(prompt, max_new_tokens=12, temperature=0, eos_token_id=None)
    assert got.tokens[0] == want and got.texts[0] == tok.decode(want)
    from meshtx.evaluate import perplexity
    text = "The notebooks are the source."
    x = torch.tensor([[0] + tok.encode(text, add_special_tokens=False)])   # the document starts with BOS
    with torch.no_grad(): nll = torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:]).item()
    assert perplexity(lm, text) == pytest.approx(math.exp(nll), rel=1e-4)


def meshtx(*args):
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_convert_both_ways_keeps_every_tensor_and_the_tokenizer(ckpt, tmp_path):
    import json
    from safetensors.numpy import load_file
    d = tmp_path / "src"
    shutil.copytree(ckpt.dir, d)
    gen = json.loads((d / "generation_config.json").read_text()) | {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (d / "generation_config.json").write_text(json.dumps(gen))   # a chat model's sampling defaults travel with it
    r = meshtx("convert", d, tmp_path / "mtx", "-q")
    assert r.returncode == 0, r.stderr
    r = meshtx("convert", tmp_path / "mtx", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    a, b = load_file(d / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a: npt.assert_array_equal(a[k], b[k])
    back = LM.from_hf(tmp_path / "hf", dtype="float32", progress=False)
    assert back.config.family == ckpt.name and back.tokenizer.chat_template == CHAT
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == gen == back.generation_config
    hf_gen = quiet_transformers().GenerationConfig.from_pretrained(tmp_path / "hf")   # as HF's generate reads it
    assert (hf_gen.temperature, hf_gen.top_p, hf_gen.eos_token_id) == (0.6, 0.9, gen["eos_token_id"])


@pytest.mark.timeout(300)
def test_serve_chat_completions_through_the_checkpoints_template(llama_dir, tmp_path):
    import httpx, openai
    from meshtx.serve import chat_prompt
    d, _, tok = llama_dir
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("MESHTX_CACHE_DIR", "off")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([exe, "serve", "--model", str(d), "--dtype", "float32", "--port", "0"], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        url, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            m = url or re.search(r" on (http://127\.0\.0\.1:\d+)", log.read_text())
            url = m if isinstance(m, str) else m and m.group(1)
            if url:
                try:
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200: break
                except httpx.HTTPError: pass
            time.sleep(0.25)
        else: pytest.fail(log.read_text())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What are the notebooks?"}]
        c = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
        prompt = chat_prompt(tok, messages, None)
        assert prompt == "<|begin_of_text|>user: What are the notebooks?\nassistant:"
        lm = LM.from_hf(d, dtype="float32", progress=False)
        assert c.choices[0].message.content == lm.generate(prompt, max_new_tokens=6, temperature=0).texts[0]
    finally:
        proc.terminate(); proc.wait(30)


class http_server:
    "`make_app(lm)` served by uvicorn on 127.0.0.1 (a free port) in a thread, for the `with` block."
    def __init__(self, lm): self.lm = lm
    def __enter__(self):
        import socket, uvicorn
        from meshtx.serve import make_app
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.lm), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"
    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def test_http_server_chats_and_scores_prompts_as_hf(ckpt):
    """The OpenAI API over real HTTP: a chat through the checkpoint's template, and a prompt's echoed log-probabilities
    equal to HF's own model's."""
    import openai, torch
    from meshtx.serve import chat_prompt
    lm = LM.from_hf(ckpt.dir, dtype="float32", progress=False)
    messages = [{"role": "user", "content": "What are the notebooks?"}]
    text = "Each notebook teaches one idea in prose, code and tests."
    with http_server(lm) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
        scored = client.completions.create(model="m", prompt=text, echo=True, logprobs=1, max_tokens=0)
    assert chat.choices[0].message.content == lm.generate(chat_prompt(ckpt.tok, messages, None), max_new_tokens=6,
                                                          temperature=0).texts[0]
    ids = ckpt.tok.encode(text, add_special_tokens=False)
    with torch.no_grad(): logp = torch.log_softmax(ckpt.model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = scored.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)   # the first token has no context, as OpenAI answers
    npt.assert_allclose(got[1:], [logp[i - 1, t] for i, t in enumerate(ids) if i], atol=1e-4)


def test_lm_eval_log_likelihoods_equal_hflm(ckpt):
    "lm-eval's own HF model and meshtx's, on the same checkpoint: the same log-likelihoods, rolling ones too."
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from meshtx.evaluate import MeshtxLM
    d = ckpt.dir
    pairs = [("The notebooks are", " the source"), ("", "meshtx"), ("A model family is", " configuration")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, ("Each notebook teaches one idea in prose, code and tests.",), 0)]
    ours = MeshtxLM(pretrained=str(d), dtype="float32", max_length=16)
    theirs = HFLM(pretrained=str(d), dtype="float32", device="cpu", batch_size=1, max_length=16)
    for a, b in zip(ours.loglikelihood(reqs, disable_tqdm=True), theirs.loglikelihood(reqs, disable_tqdm=True)):
        assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True)[0] == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True)[0], abs=1e-3)


def test_full_fine_tune_from_the_widget_saved_and_sampled(ckpt, tmp_path):
    """Full fine-tuning steps from the widget's Step and Start buttons, saved by its Save button and loaded back as a
    model; the sampler widget on it writes `generate`'s text."""
    import itertools, jax
    from meshtx.checkpoint import Checkpointer
    from meshtx.train import Trainer
    from meshtx.widgets import FinetuneWidget, SamplerWidget
    batch = np.random.default_rng(0).integers(0, ckpt.cfg.n_vocab, (1, 2, 17))
    t = Trainer(LM.from_hf(ckpt.dir, dtype="float32", progress=False), itertools.repeat(batch), lr=1e-3,
                checkpoint_dir=tmp_path / "ck", progress=False, total_steps=3)
    w = FinetuneWidget(t, eval_every=None, plot_every=1)
    w.step_button.click()
    assert w.controller.wait(120) and w.controller.steps_done == 1
    w.start_button.click()
    assert w.controller.wait(120) and w.controller.steps_done == 3, w.error.value
    losses = [r["loss"] for r in t.history]
    assert losses[-1] < losses[0] and w.error.value == ""
    w.save_button.click()
    assert "saved" in w.activity.value and Checkpointer(tmp_path / "ck").steps() == [3]
    lm = LM.load(tmp_path / "ck")
    assert lm.config.family == ckpt.name and lm.config.n_kv_head == ckpt.cfg.n_kv_head
    jax.tree.map(npt.assert_array_equal, jax.tree.map(np.asarray, lm.params), jax.tree.map(np.asarray, t.lm.params))
    lm.tokenizer = t.lm.tokenizer
    s = SamplerWidget(lm, prompt="The notebooks")
    s.temperature.value, s.max_tokens.value = 0.0, 6
    s.generate_button.click()
    assert s.controller.wait(120)
    assert s.controller.text == lm.generate("The notebooks", max_new_tokens=6, temperature=0).texts[0]


def test_finetune_and_eval_command_lines(ckpt, tmp_path):
    """`meshtx finetune --lora` as a process on the family's checkpoint: adapters on the family's targets, merged into a
    Hugging Face checkpoint that the family's own class loads with meshtx's logits; then `meshtx eval` as a process on
    that model, a local task, whose logged log-likelihoods equal lm-eval's own HF model's."""
    import json, lm_eval
    from conftest import write_task
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from safetensors.numpy import load_file
    (tmp_path / "text.txt").write_text(README.read_text()[:6000])
    r = meshtx("finetune", "--model", ckpt.dir, "--data", tmp_path / "text.txt", "--out", tmp_path / "out", "--lora", 4,
               "--steps", 8, "--batch", 4, "--seq", 16, "--lr", 1e-2, "--dtype", "float32", "-q")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    before, after = (float(x) for x in re.findall(r"held-out loss (?:before|after \d+ steps): ([\d.]+)", r.stdout))
    assert after < before, r.stdout
    model = tmp_path / "out" / "model"
    lm = LM.from_hf(model, dtype="float32", progress=False)
    hf = quiet_transformers().AutoModelForCausalLM.from_pretrained(model).eval()
    assert type(hf) is type(ckpt.model) and lm.config.family == ckpt.name
    tokens = np.random.default_rng(4).integers(0, ckpt.cfg.n_vocab, (2, 12))
    ours = np.asarray(lm.logits(tokens))
    npt.assert_allclose(ours, hf_logits(hf, tokens), atol=1e-4, rtol=0)
    assert np.abs(ours - hf_logits(ckpt.model, tokens)).max() > 1e-3   # the adapters changed the model
    names = " ".join(load_file(tmp_path / "out" / "adapters" / "lora.safetensors"))
    assert ("lora_fc_gate_a" in names) == ckpt.cfg.gated_mlp and "lora_q_a" in names, names

    tasks = tmp_path / "tasks"; tasks.mkdir()
    docs = [{"q": "The notebooks are", "choices": ["the source", "a copy"], "answer": 0},
            {"q": "A family is", "choices": ["configuration", "a zoo", "code"], "answer": 0}]
    write_task(tasks, "fam_mc", docs, output_type="multiple_choice", doc_to_text="{{q}}", doc_to_choice="{{choices}}",
               doc_to_target="answer", metric_list=[{"metric": "acc"}])
    r = meshtx("eval", "--model", "meshtx", "--model_args", f"pretrained={model},dtype=float32", "--tasks", "fam_mc",
               "--include_path", tasks, "--output_path", tmp_path / "eval", "--log_samples")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "eval").rglob("samples_fam_mc_*.jsonl") for line in open(f)]
    args = [(a["arg_0"], a["arg_1"]) for s in samples for a in s["arguments"].values()]   # (context, continuation)
    got = [float(r[0][0]) for s in samples for r in s["resps"]]
    assert len(args) == len(got) == 5, samples
    theirs = HFLM(pretrained=str(model), dtype="float32", device="cpu", batch_size=1)
    want = [ll for ll, _ in theirs.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)],
                                                 disable_tqdm=True)]
    npt.assert_allclose(got, want, atol=1e-4)
