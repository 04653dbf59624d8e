"""A Llama checkpoint with its own tokenizer (trained offline with `tokenizers` on local text) and chat template,
through the faces users meet: `LM.from_hf` text generation equal to HF's, `meshtx convert` both ways, `meshtx serve`'s
chat completions, and perplexity equal to HF's."""
import math, os, re, shutil, subprocess, sys, time
from pathlib import Path
import numpy as np
import numpy.testing as npt
import pytest
from test_families import LLAMA, make_hf
from meshtx import LM
from meshtx.config import quiet_transformers

CHAT = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
CFG = LLAMA.replace(bos_token_id=0, eos_token_id=1)


def train_tokenizer(vocab: int):
    "A byte-level BPE of `vocab` tokens, trained on this repository's README, with `<|begin_of_text|>` 0 and `<|end_of_text|>` 1."
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(Path(__file__).parent.parent / "README.md").read_text()], trainer)
    return quiet_transformers().PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                       eos_token="<|end_of_text|>", chat_template=CHAT)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama") / "ckpt"
    model = make_hf(CFG, seed=3)
    model.save_pretrained(d)
    tok = train_tokenizer(CFG.n_vocab)
    assert len(tok) == CFG.n_vocab
    tok.save_pretrained(d)
    return d, model, tok


def test_text_generation_and_perplexity_equal_hf(llama_dir):
    import torch
    d, model, tok = llama_dir
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


def test_convert_both_ways_keeps_every_tensor_and_the_tokenizer(llama_dir, tmp_path):
    from safetensors.numpy import load_file
    d, _, _ = llama_dir
    r = meshtx("convert", d, tmp_path / "mtx", "-q")
    assert r.returncode == 0, r.stderr
    r = meshtx("convert", tmp_path / "mtx", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    a, b = load_file(d / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a: npt.assert_array_equal(a[k], b[k])
    back = LM.from_hf(tmp_path / "hf", dtype="float32", progress=False)
    assert back.config.family == "llama" and back.tokenizer.chat_template == CHAT


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


def test_lm_eval_log_likelihoods_equal_hflm(llama_dir):
    "lm-eval's own HF model and meshtx's, on the same Llama checkpoint: the same log-likelihoods, rolling ones too."
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from meshtx.evaluate import MeshtxLM
    d, _, _ = llama_dir
    pairs = [("The notebooks are", " the source"), ("", "meshtx"), ("A model family is", " configuration")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, ("Each notebook teaches one idea in prose, code and tests.",), 0)]
    ours = MeshtxLM(pretrained=str(d), dtype="float32", max_length=16)
    theirs = HFLM(pretrained=str(d), dtype="float32", device="cpu", batch_size=1, max_length=16)
    for a, b in zip(ours.loglikelihood(reqs, disable_tqdm=True), theirs.loglikelihood(reqs, disable_tqdm=True)):
        assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True)[0] == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True)[0], abs=1e-3)


def test_full_fine_tune_checkpoint_and_sampler_widget(llama_dir, tmp_path):
    "A full fine-tuning step of the Llama, saved and loaded back as a model; the sampler widget on it writes its text."
    import itertools, jax
    from meshtx.train import Trainer
    from meshtx.widgets import SamplerWidget
    d, _, _ = llama_dir
    batch = np.random.default_rng(0).integers(0, CFG.n_vocab, (1, 2, 17))
    t = Trainer(LM.from_hf(d, dtype="float32", progress=False), itertools.repeat(batch), lr=1e-3,
                checkpoint_dir=tmp_path / "ck", progress=False)
    losses = [t.step()["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    t.save()
    lm = LM.load(tmp_path / "ck")
    assert lm.config.family == "llama" and lm.config.n_kv_head == 2
    jax.tree.map(npt.assert_array_equal, jax.tree.map(np.asarray, lm.params), jax.tree.map(np.asarray, t.lm.params))
    lm.tokenizer = t.lm.tokenizer
    w = SamplerWidget(lm, prompt="The notebooks")
    w.temperature.value, w.max_tokens.value = 0.0, 6
    w.generate_button.click()
    assert w.controller.wait(120)
    assert w.controller.text == lm.generate("The notebooks", max_new_tokens=6, temperature=0).texts[0]
