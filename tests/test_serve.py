"""`meshtx serve` as a user runs it: a real server process on 127.0.0.1, real HTTP clients, the `openai` client."""
import json, os, re, shutil, signal, subprocess, sys, tempfile, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import httpx
import pytest
from meshtx import LM

pytestmark = pytest.mark.timeout(300)


class Server:
    """A `meshtx serve --preset demo --port 0` process on 127.0.0.1, its output in a log file: the port is the one its
    first line says it got (which `-q` does not silence)."""
    def __init__(self, log_dir, *args):
        self.url = None
        exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one CPU device, as users have
        env.setdefault("MESHTX_CACHE_DIR", "off")
        self._log = tempfile.NamedTemporaryFile("w", dir=log_dir, prefix="serve-", suffix=".log", delete=False)
        self.log = Path(self._log.name)
        self.proc = subprocess.Popen([exe, "serve", "--preset", "demo", "--port", "0", *map(str, args)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def output(self): return self.log.read_text()

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"meshtx serve exited with {self.proc.returncode}:\n{self.output()}")
            if self.url is None:
                m = re.match(r"meshtx: serving demo: LM\(.*\) on (http://127\.0\.0\.1:[1-9]\d*)\n", self.output())
                self.url = m and m.group(1)
            else:
                try:
                    if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200: return self
                except httpx.HTTPError: pass
            time.sleep(0.25)
        pytest.fail(f"meshtx serve did not answer within {timeout} s:\n{self.output()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try: self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill(); self.proc.wait(10)
        self._log.close()

    def post(self, path, **kwargs): return httpx.post(f"{self.url}{path}", timeout=120, **kwargs)
    def stats(self): return httpx.get(f"{self.url}/stats", timeout=10).json()


CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers, started together: the defaults, a quiet one with room for one running and one queued prompt
    (and batches of one), and one with the defaults for a test to stop."""
    log_dir = tmp_path_factory.mktemp("serve-logs")
    (log_dir / "chat.jinja").write_text(CHAT_TEMPLATE)
    started = []
    try:
        started.append(Server(log_dir, "--chat-template", log_dir / "chat.jinja", "--max-request-mb", 1))
        started.append(Server(log_dir, "--max-batch", 1, "--max-queue", 1, "--batch-wait-ms", 0, "-q"))
        started.append(Server(log_dir))
        for s in started: s.wait_ready()
        yield {"main": started[0], "tight": started[1], "to_stop": started[2]}
    finally:
        for s in started: s.stop()


@pytest.fixture(scope="module")
def server(servers): return servers["main"]


@pytest.fixture(scope="module")
def demo():
    return LM.init("demo")   # the same random weights as the server's `--preset demo` (seed 0)


PROMPTS = [f"Client {i} would like to hear about {topic}" for i, topic in
           enumerate(["JAX", "GPT-J", "the sea", "mountains", "tea", "compilers", "rain", "maps",
                      "birds", "chess", "bread", "rivers", "trains", "jazz", "paper", "stars"])]
LENGTHS = [4 + i % 5 for i in range(16)]


def greedy(demo, prompt, n):
    return demo.generate(prompt, max_new_tokens=n, temperature=0)


def test_sixteen_concurrent_clients_are_batched_and_get_their_own_greedy_text(server, demo):
    expected = [greedy(demo, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    before = server.stats()["generate_calls"]
    start = threading.Barrier(16)
    def ask(i):
        start.wait()
        return server.post("/v1/completions", json={"model": "demo", "prompt": PROMPTS[i], "max_tokens": LENGTHS[i],
                                                    "temperature": 0})
    with ThreadPoolExecutor(16) as ex: answers = list(ex.map(ask, range(16)))
    assert [a.status_code for a in answers] == [200] * 16, [a.text for a in answers if a.status_code != 200]
    bodies = [a.json() for a in answers]
    assert [b["choices"][0]["text"] for b in bodies] == [g.texts[0] for g in expected]
    assert [b["choices"][0]["finish_reason"] for b in bodies] == [g.finish_reasons[0] for g in expected]
    assert [b["usage"]["completion_tokens"] for b in bodies] == [len(g.tokens[0]) for g in expected]
    assert all(b["object"] == "text_completion" and b["model"] == "demo" for b in bodies)
    stats = server.stats()
    assert stats["generate_calls"] - before < 16, stats                 # requests shared generate calls
    assert max(map(int, stats["batch_sizes"])) > 1, stats


def test_complete_has_the_original_shape(server, demo):
    r = server.post("/complete", json={"context": PROMPTS[0], "top_p": 0.9, "temp": 0, "max_tokens": 6})
    assert r.status_code == 200 and r.json() == {"completion": greedy(demo, PROMPTS[0], 6).texts[0]}
    r = server.post("/complete", json={"context": "EleutherAI is", "top_p": 0.9, "temp": 0.75, "max_tokens": 8})
    assert r.status_code == 200 and list(r.json()) == ["completion"] and isinstance(r.json()["completion"], str)


def test_the_openai_client_works_plain_and_streamed(server, demo):
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["demo"]
    c = client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=LENGTHS[3], temperature=0)
    assert c.choices[0].text == greedy(demo, PROMPTS[3], LENGTHS[3]).texts[0]
    pieces = list(client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=LENGTHS[3], temperature=0,
                                            stream=True))
    assert len(pieces) > 1
    assert "".join(p.choices[0].text for p in pieces) == c.choices[0].text
    assert pieces[-1].choices[0].finish_reason == c.choices[0].finish_reason   # streamed or not, the same reason
    # a stop string inside the text: both say "stop", and both cut the text there
    stop = c.choices[0].text[len(c.choices[0].text) // 2:][:3]
    s = client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=LENGTHS[3], temperature=0, stop=stop)
    pieces = list(client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=LENGTHS[3], temperature=0,
                                            stop=stop, stream=True))
    assert s.choices[0].finish_reason == pieces[-1].choices[0].finish_reason == "stop"
    assert "".join(p.choices[0].text for p in pieces) == s.choices[0].text == c.choices[0].text[:c.choices[0].text.find(stop)]
    # stream_options: a last chunk, with no choices, carries the usage a plain answer has
    pieces = list(client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=LENGTHS[3], temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert pieces[-1].choices == [] and pieces[-1].usage == c.usage and all(p.usage is None for p in pieces[:-1])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="demo", prompt="x", max_tokens=4, top_p=5)
    # on the wire: server-sent events ending with [DONE]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]" and all(l.startswith("data: {") for l in lines[:-1])


def test_bad_requests_are_400_naming_the_field_and_the_server_keeps_serving(server, demo):
    r = server.post("/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    for body, field in [({"prompt": "x", "top_p": 5}, "top_p"), ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                        ({"prompt": "x", "temperature": "warm"}, "temperature"), ({"max_tokens": 4}, "prompt"),
                        ({"prompt": "hello " * 600, "max_tokens": 4}, "prompt"),
                        ({"prompt": "hello " * 600, "max_tokens": 4, "stream": True}, "prompt")]:
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], (body, err)
    assert "n_ctx=512" in server.post("/v1/completions", json={"prompt": "hello " * 600}).json()["error"]["message"]
    r = server.post("/complete", json={"context": "x", "top_p": 5, "temp": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    # what a web page can make a browser send cross-origin without a preflight is not run
    before = server.stats()["generate_calls"]
    r = server.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                    headers={"content-type": "text/plain;charset=UTF-8", "origin": "https://example.com"})
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    assert server.stats()["generate_calls"] == before
    r = server.post("/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": LENGTHS[5], "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(demo, PROMPTS[5], LENGTHS[5]).texts[0]


def test_a_lone_surrogate_fails_only_its_own_request(server, demo):
    "JSON may spell a lone surrogate (valid JSON, not text): a 400 naming the field; the requests sent with it are served."
    bad = [b'{"prompt": "bad \\ud800", "max_tokens": 4}', b'{"prompt": "x", "max_tokens": 4, "stop": ["\\udfff"]}']
    good = [json.dumps({"prompt": PROMPTS[i], "max_tokens": LENGTHS[i], "temperature": 0}).encode() for i in range(6)]
    start = threading.Barrier(len(bad) + len(good))
    def ask(body):
        start.wait()
        return server.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    with ThreadPoolExecutor(len(bad) + len(good)) as ex: answers = list(ex.map(ask, bad + good))
    assert [(a.status_code, a.json()["error"]["param"]) for a in answers[:2]] == [(400, "prompt"), (400, "stop")]
    assert [a.json()["choices"][0]["text"] for a in answers[2:]] == [greedy(demo, PROMPTS[i], LENGTHS[i]).texts[0] for i in range(6)]


def test_the_prompts_of_a_request_are_sampled_with_seeds_of_their_own(server):
    body = {"prompt": [PROMPTS[0]] * 4, "max_tokens": 6, "temperature": 1.0}
    texts = [c["text"] for c in server.post("/v1/completions", json=body).json()["choices"]]
    assert len(set(texts)) == 4, texts                                   # no seed: four samples
    seeded = [c["text"] for c in server.post("/v1/completions", json={**body, "seed": 5}).json()["choices"]]
    alone = server.post("/v1/completions", json={**body, "prompt": PROMPTS[0], "seed": 7}).json()["choices"][0]["text"]
    assert seeded[2] == alone                                            # seed 5: the third prompt samples with seed 7


def test_a_full_queue_is_503_and_the_server_recovers(servers):
    tight = servers["tight"]          # one prompt generating, one queued: a third concurrent one is refused
    start = threading.Barrier(8)
    def ask(i):
        start.wait()
        return tight.post("/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 40, "temperature": 0})
    with ThreadPoolExecutor(8) as ex: answers = list(ex.map(ask, range(8)))
    codes = sorted(a.status_code for a in answers)
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    busy = next(a for a in answers if a.status_code == 503).json()["error"]
    assert "busy" in busy["message"] and busy["type"] == "server_error"
    r = tight.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def test_serve_needs_a_model(tmp_path):
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    r = subprocess.run([exe, "serve"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--model" in r.stderr and "--preset" in r.stderr


def test_a_request_with_more_prompts_than_max_batch_is_split(server, demo):
    before = server.stats()["batch_sizes"]   # --max-batch 8: ten prompts are two generate calls, of 8 and 2 rows
    r = server.post("/v1/completions", json={"prompt": PROMPTS[:10], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [greedy(demo, p, 4).texts[0] for p in PROMPTS[:10]]
    after = server.stats()["batch_sizes"]
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {"8": 1, "2": 1}, (before, after)


def test_a_queued_request_whose_client_gave_up_is_not_run(servers):
    tight = servers["tight"]          # one prompt running, one queued
    before = tight.stats()["generate_calls"]
    long = {"prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0}
    with ThreadPoolExecutor(1) as ex:
        running = ex.submit(tight.post, "/v1/completions", json=long)
        deadline = time.monotonic() + 60
        while not tight.stats()["busy"]:
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.02)
        with pytest.raises(httpx.TimeoutException):   # queued behind it; the client leaves after 0.3 s
            httpx.post(f"{tight.url}/v1/completions", json=long, timeout=0.3)
        while tight.stats()["queued"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert tight.stats()["busy"] and not running.done()   # it left the queue while the first still ran
        assert running.result().status_code == 200
    time.sleep(0.5)
    stats = tight.stats()
    assert stats["generate_calls"] - before == 1 and not stats["busy"], stats


def test_sigterm_answers_queued_requests_at_once_ends_the_stream_and_exits(servers):
    s = servers["to_stop"]
    lines, started = [], threading.Event()
    def running():                    # a stream of 8 x 480 tokens: still running when the signal comes
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120, json={
                "prompt": [PROMPTS[2]] * 8, "max_tokens": 480, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line: lines.append(line); started.set()
    def queued(stream):
        r = s.post("/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 8, "stream": stream})
        return r.status_code, r.json()["error"]["message"], time.monotonic()
    with ThreadPoolExecutor(3) as ex:
        stream = ex.submit(running)
        assert started.wait(120), s.output()
        waiting = [ex.submit(queued, False), ex.submit(queued, True)]
        deadline = time.monotonic() + 10
        while s.stats()["queued"] < 2:
            assert time.monotonic() < deadline, s.stats()
            time.sleep(0.02)
        assert s.stats()["busy"] and not stream.done()
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        answers = [w.result(30) for w in waiting]
        s.proc.wait(30)
        exited = time.monotonic() - t0
        stream.result(30)
    assert [a[:2] for a in answers] == [(503, "the server is shutting down")] * 2, answers
    assert max(a[2] for a in answers) - t0 < 3, answers          # at once, not after the running stream
    assert exited < 10, exited
    assert lines[-1] == "data: [DONE]" and "the server is shutting down" in lines[-2], lines[-3:]
    assert "Traceback" not in s.output(), s.output()


def test_logprobs_echo_and_prompt_scoring_equal_the_evaluators_scores(server, demo):
    "What lm-eval sends to score text (echo, logprobs, max_tokens 0 or 1): the evaluator's numbers, the first token null."
    from meshtx.evaluate import score
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    ids = demo.tokenizer(PROMPTS[4]).input_ids
    for max_tokens in (0, 1):
        c = client.completions.create(model="demo", prompt=ids, max_tokens=max_tokens, logprobs=2, echo=True, temperature=0)
        lp = c.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + max_tokens and "".join(lp.tokens[:len(ids)]) == PROMPTS[4]
        assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        total, greedy_all = score(demo, [ids], [len(ids) - 1])[0]
        assert abs(sum(lp.token_logprobs[1:len(ids)]) - total) < 1e-3, (sum(lp.token_logprobs[1:len(ids)]), total)
        for t, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
            assert t in top and 2 <= len(top) <= 3   # the two likeliest, and the chosen one
        assert c.usage.prompt_tokens == len(ids) and c.usage.completion_tokens == max_tokens
    # the generated tokens' log-probabilities: the model's own, as the evaluator scores the whole text
    g = client.completions.create(model="demo", prompt=PROMPTS[4], max_tokens=5, logprobs=0, temperature=0)
    gen = demo.tokenizer(g.choices[0].text).input_ids
    assert "".join(g.choices[0].logprobs.tokens) == g.choices[0].text
    total = score(demo, [ids + gen], [len(gen)])[0][0]
    assert abs(sum(g.choices[0].logprobs.token_logprobs) - total) < 1e-3


def test_n_best_of_penalties_and_logit_bias(server, demo):
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    c = client.completions.create(model="demo", prompt=[PROMPTS[0], PROMPTS[1]], n=2, max_tokens=6, seed=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3] and c.choices[0].text != c.choices[1].text
    alone = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=6, seed=5)
    assert c.choices[2].text == alone.choices[0].text                        # choice 2: the second prompt, seed 3 + 2
    again = client.completions.create(model="demo", prompt=[PROMPTS[0], PROMPTS[1]], n=2, max_tokens=6, seed=3)
    assert [ch.text for ch in again.choices] == [ch.text for ch in c.choices]  # reproducible
    b = client.completions.create(model="demo", prompt=PROMPTS[0], n=1, best_of=3, max_tokens=6, seed=3)
    assert len(b.choices) == 1 and b.usage.completion_tokens == 18           # three sampled, one returned
    # logit_bias: +100 makes a token the greedy choice; the penalties are accepted and change sampling
    forced = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias={"11": 100})
    assert forced.choices[0].text == demo.tokenizer.decode([11, 11, 11])
    kw = dict(max_tokens=12, temperature=0, logit_bias={"11": 8, "13": 7})   # a model inclined to say 11 11 11 ...
    plain = client.completions.create(model="demo", prompt=PROMPTS[0], **kw)
    pen = client.completions.create(model="demo", prompt=PROMPTS[0], frequency_penalty=2, presence_penalty=1.5, **kw)
    assert pen.choices[0].text != plain.choices[0].text                      # the penalties had work to do
    ref = demo.generate(PROMPTS[0], max_new_tokens=12, temperature=0, logit_bias={11: 8, 13: 7}, frequency_penalty=2,
                        presence_penalty=1.5)
    assert pen.choices[0].text == ref.texts[0]                               # and did what `generate` does
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, logit_bias={"999999": 1})


def test_chat_completions_plain_and_streamed_through_the_template(servers, demo):
    import openai
    from meshtx.serve import chat_prompt
    server = servers["main"]      # started with --chat-template
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Tell me about JAX."}]
    c = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    prompt = chat_prompt(demo.tokenizer, messages, CHAT_TEMPLATE)
    assert prompt == "User: Tell me about JAX.\nAssistant:"
    expected = greedy(demo, prompt, 8).texts[0]
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == expected
    assert "".join(t.token for t in c.choices[0].logprobs.content) == expected
    assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)
    pieces = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0, stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == expected
    assert pieces[-1].choices[0].finish_reason == "length"
    two = client.chat.completions.create(model="demo", messages=messages, max_tokens=4, n=2, seed=1)
    assert [ch.index for ch in two.choices] == [0, 1]
    # a tokenizer without a chat template (GPT-2's) and no --chat-template: a 400 that says what to do
    with pytest.raises(openai.BadRequestError, match="--chat-template FILE"):
        openai.OpenAI(base_url=f"{servers['tight'].url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="demo", messages=messages, max_tokens=2)


def test_offsets_of_split_characters_and_the_chat_apis_own_names(server, demo):
    """Echoed logprobs of text whose characters split over tokens (an emoji, Japanese): one entry per token, each offset
    where the text the tokens before it make whole ends; chat's bytes join to the text; chat errors name chat's fields."""
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    text = "Tea 😀 and 日本語, ok"
    ids = demo.tokenizer(text).input_ids
    lp = client.completions.create(model="demo", prompt=text, max_tokens=0, logprobs=1, echo=True).choices[0].logprobs
    assert len(lp.tokens) == len(ids) and any("\ufffd" in t for t in lp.tokens)   # some tokens are parts of a character
    whole = [len(os.path.commonprefix([demo.tokenizer.decode(ids[:k]), text])) for k in range(len(ids))]
    assert lp.text_offset == whole
    messages = [{"role": "user", "content": "Tell me about 日本."}]
    c = client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0, logprobs=True)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and bytes(sum((t.bytes for t in content), [])).decode() == c.choices[0].message.content
    # a null max_completion_tokens is unset (max_tokens counts); chat's errors name chat's own fields
    r = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "max_completion_tokens": None})
    assert r.json()["usage"]["completion_tokens"] == 3
    err = server.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 0}).json()["error"]
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens=0" in err["message"]
    long = [{"role": "user", "content": "tea " * demo.config.n_ctx}]
    err = server.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4}).json()["error"]
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    err = server.post("/v1/completions", json={"prompt": ["a", "b"], "n": 40, "max_tokens": 1}).json()["error"]
    assert err["param"] == "n" and "80 completions" in err["message"], err


def test_offsets_start_after_a_bos_the_tokenizer_added(demo):
    "A BOS that Llama's tokenizers put before the text is not in it: it starts at 0, and the text's tokens where they are."
    from meshtx.serve import Batcher
    b, tok = Batcher(demo, continuous=False), demo.tokenizer
    eot = tok.eos_token_id
    assert b._offsets([eot] + tok("Hello world").input_ids, "Hello world") == [0, 0, 5]
    assert b._offsets(tok("a<|endoftext|>b").input_ids, "a<|endoftext|>b") == [0, 1, 14]   # one the text holds: in place
    assert b._offsets(tok(" 日本").input_ids, " 日本") == [0, 1, 1, 2, 2]   # five tokens: " " and a byte, then bytes
    from meshtx.serve import Job   # a model without a tokenizer has no text, but its logprobs still name each token's id
    bare = Batcher(LM.init("tiny"), continuous=False)
    job = Job([[1, 2, 3]], max_tokens=3, temperature=0, logprobs=1); bare._encode(job)
    [r] = bare._drain([(job, 0)], bare._open([(job, 0)]))
    assert r["text"] == "" and [e["token"] for e in r["logprobs"]] == [str(t) for t in LM.init("tiny").generate([[1, 2, 3]], max_new_tokens=3, temperature=0).tokens[0]]


def test_big_bodies_prompts_and_stops_are_refused_before_they_are_read_or_tokenized(server, demo):
    import socket
    big = b'{"prompt": "' + b"x" * (50 * 2**20) + b'"}'
    try: r = server.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    except (httpx.WriteError, httpx.RemoteProtocolError): r = None   # the server answered and closed while it was sent
    assert r is None or (r.status_code == 413 and "1,048,576 bytes" in r.json()["error"]["message"]), r and r.text
    def chunked():                # no Content-Length: counted as it comes
        for _ in range(40): yield b" " * 2**16
    r = server.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    r = server.post("/v1/completions", json={"prompt": "word " * 20000, "max_tokens": 2})   # 100,000 characters
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    r = server.post("/v1/completions", json={"prompt": "x", "stop": "s" * 1000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    # a client that sends half a body and hangs up: no traceback in the log
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
    time.sleep(0.5)
    r = server.post("/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": LENGTHS[5], "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(demo, PROMPTS[5], LENGTHS[5]).texts[0]
    assert "Traceback" not in server.output() and "ClientDisconnect" not in server.output(), server.output()[-3000:]


def test_new_stop_shapes_compile_nothing_new(server):
    ask = lambda stop: server.post("/v1/completions", json={"prompt": PROMPTS[6], "max_tokens": 6, "temperature": 0, "stop": stop})
    assert ask(["zz"]).status_code == 200
    before = server.stats()["compiled"]
    for stop in (["a b c d e"], ["q", "rr", "sss"], [f"stop{i}" for i in range(16)], ["a longer stop string, of some words"]):
        assert ask(stop).status_code == 200
    assert server.stats()["compiled"] == before, (before, server.stats()["compiled"])


def test_a_short_request_does_not_wait_for_a_long_one(server, demo):
    """Continuous batching: a 3-token request sent while a 480-token stream runs is answered while the stream still
    runs (in a row of its own, joining between two device calls), and neither changes the other's text."""
    long = {"prompt": PROMPTS[4], "max_tokens": 480, "temperature": 0, "stream": True}
    pieces, started, finished = [], threading.Event(), []
    def stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"]); started.set()
        finished.append("long")
    with ThreadPoolExecutor(1) as ex:
        running = ex.submit(stream)
        assert started.wait(120)
        short = server.post("/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 3, "temperature": 0})
        finished.append("short")
        # scoring (lm-eval's loglikelihood request) and best-of join the rows too: neither waits for the stream
        scored = server.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 0, "echo": True, "logprobs": 1})
        best = server.post("/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 3, "best_of": 2, "logprobs": 2, "seed": 1})
        finished.append("scored and best")
        running.result(300)
    assert finished == ["short", "scored and best", "long"]
    assert short.json()["choices"][0]["text"] == greedy(demo, PROMPTS[5], 3).texts[0]
    assert scored.status_code == 200 and best.status_code == 200, (scored.text, best.text)
    lp = scored.json()["choices"][0]["logprobs"]
    n_prompt = scored.json()["usage"]["prompt_tokens"]
    assert len(lp["token_logprobs"]) == n_prompt and lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    [choice] = best.json()["choices"]
    assert len(choice["logprobs"]["tokens"]) == 3 and all(len(t) >= 2 for t in choice["logprobs"]["top_logprobs"])
    assert best.json()["usage"]["completion_tokens"] == 6   # both samples' tokens are counted
    assert "".join(pieces) == greedy(demo, PROMPTS[4], 480).texts[0]
    stats = server.stats()
    assert stats["continuous"] and stats["decode_calls"] > 0, stats


def test_static_batching_is_a_flag(tmp_path):
    exe = shutil.which("meshtx") or str(Path(sys.executable).parent / "meshtx")
    r = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "--static-batching" in r.stdout and "Continuous batching" in r.stdout


def test_a_request_longer_than_a_row_runs_as_generate(demo):
    """Rows hold `slot_len` tokens (by default what half the free memory holds): a request that needs more runs alone
    as a `generate` batch, and gets the same text; the short ones beside it run in the rows."""
    import asyncio
    from meshtx.serve import Batcher, Job
    b = Batcher(demo, max_batch=2, slot_len=32)
    b.start()
    try:
        async def ask():
            jobs = [Job([PROMPTS[0]], max_tokens=40, temperature=0), Job([PROMPTS[1]], max_tokens=5, temperature=0)]
            return await asyncio.gather(*(b.complete(j) for j in jobs))
        long, short = asyncio.run(ask())
    finally: b.close()
    assert long[0]["text"] == greedy(demo, PROMPTS[0], 40).texts[0]
    assert short[0]["text"] == greedy(demo, PROMPTS[1], 5).texts[0]
    stats = b.stats()
    assert stats["slot_len"] == 32 and stats["decode_calls"] > 0 and stats["generate_calls"] >= 2, stats
    assert Batcher(demo).stats()["slot_len"] == demo.config.n_ctx   # all of n_ctx (512): this machine has the memory


def test_a_request_without_max_tokens_fills_a_row_beside_the_others(demo):
    """Chat's default (no max_tokens) is the room a row leaves, when rows are shorter than the context: such requests
    run in the slots together (none alone as a `generate` batch), and each ends where a row does."""
    import asyncio
    from meshtx.serve import Batcher, Job
    b = Batcher(demo, max_batch=2, slot_len=24)
    b.start()
    try:
        async def ask():
            jobs = [Job([p], max_tokens=None, temperature=0) for p in PROMPTS[:2]]
            return await asyncio.gather(*(b.complete(j) for j in jobs)), jobs
        results, jobs = asyncio.run(ask())
    finally: b.close()
    for p, job, r in zip(PROMPTS, jobs, results):
        n = len(demo.tokenizer(p).input_ids)
        assert job.max_tokens == 24 - n and b._continuous(job), (job.max_tokens, n)   # it fits a row, so it ran in one
        assert r[0]["text"] == greedy(demo, p, 24 - n).texts[0]
    assert b.stats()["decode_calls"] > 0


def test_logprob_entries_of_a_sentencepiece_model_with_byte_tokens():
    "A Llama-2-style tokenizer (Metaspace, `<0xNN>` byte fallback): offsets from the tokens' own bytes (each byte of a "
    "character starts where it does), pieces with the space `▁` stands for, alternatives of one text ('�') each kept, "
    "no stop string matched in a character still coming, and a chat template that does not parse refused at the start."
    from test_sampling import sp_tokenizer
    from meshtx.config import ModelConfig
    from meshtx.sampling import _first_stop
    from meshtx.serve import Batcher, RequestError, _chat_logprobs, _completion_logprobs, chat_prompt, make_app
    tok = sp_tokenizer()
    lm = LM.init(ModelConfig(n_layer=1, d_model=32, n_head=2, rotary_dim=8, n_vocab=len(tok), n_ctx=64), tokenizer=tok)
    b = Batcher(lm, continuous=False)
    ids = tok("中文😀 one", add_special_tokens=False).input_ids   # ▁, then 中's, 文's and 😀's bytes, then ▁one
    assert len(ids) == 12 and tok.decode(ids) == "中文😀 one"
    assert b._offsets(ids, "中文😀 one") == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
    assert b._offsets(ids[1:], "中文😀 one") == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
    one, x80, x81 = tok.convert_tokens_to_ids(["▁one", "<0x80>", "<0x81>"])
    assert b._piece(one) == " one" and b._token_bytes(one) == list(b" one")
    [e] = b._entries([x81], [-1.5], [{x80: -1.0, x81: -1.5, one: -2.0}], 3, [0])
    assert [(t, lp) for t, lp, _ in e["top"]] == [("�", -1.0), ("�", -1.5), (" one", -2.0)]
    assert _chat_logprobs([e], 3)["content"][0]["top_logprobs"] == [
        {"token": "�", "logprob": -1.0, "bytes": [0x80]}, {"token": "�", "logprob": -1.5, "bytes": [0x81]},
        {"token": " one", "logprob": -2.0, "bytes": list(b" one")}]
    assert _completion_logprobs([e])["top_logprobs"] == [{"�": -1.0, " one": -2.0}]   # one text: the likelier
    eos = tok.eos_token_id
    assert [_first_stop(lm, ids[:k], eos, ["\ufffd"]) for k in range(len(ids) + 1)] == [None] * (len(ids) + 1)
    assert _first_stop(lm, ids, eos, ["文"]) == 7   # (the tokens to 文's last byte)
    broken = "{% for m in messages %}{{ m.content }}"
    with pytest.raises(ValueError, match="does not parse"): make_app(lm, chat_template=broken)
    tok.chat_template = broken   # the tokenizer's own: the server's fault (500), not the messages' (400)
    with pytest.raises(RequestError) as e: chat_prompt(tok, [{"role": "user", "content": "Hi"}])
    assert e.value.status == 500 and "does not parse" in e.value.message
