"""`flashdraft serve`: a real server on 127.0.0.1, spoken to with the official openai client.

The main server runs in a subprocess, launched by the CLI, with the tiny target as its own
draft model (so that drafted and accepted tokens move). Tests that need a request to stay
running for a known time (a full queue, clients that leave) or the engine to fail use a
second server, with --max-queue 1, in a thread of this process: a real uvicorn on 127.0.0.1
over an LLM whose deltas wait on a gate or a delay, or raise.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.serving.server import ServerSettings, create_app  # noqa: E402
from tests.tiny import build_model  # noqa: E402

NAME = "tiny-chat"
KEY = "sk-test-key"
K = 3
MAX_LEN = 256  # below the tiny model's 512, so that --max-model-len is what limits
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello to the quick brown fox."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("server-model") / "qwen2")


@pytest.fixture(scope="module")
def llm(tiny):
    """The offline reference, set up as the server is."""
    return LLM(str(tiny), draft=str(tiny), num_speculative_tokens=K, device="cpu",
               max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "--model", str(tiny),
           "--draft", str(tiny), "--num-speculative-tokens", str(K), "--device", "cpu",
           "--port", str(port), "--api-key", KEY, "--served-model-name", NAME,
           "--max-queue", "64", "--max-model-len", str(MAX_LEN)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, 60, "the server's /health", poll=0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, through prometheus_client's parser."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- answers equal offline generation ---------------------------------------------------------

def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].max_model_len == MAX_LEN  # an extra field, as vLLM gives


@pytest.mark.parametrize("settings", [dict(temperature=0.0),
                                      dict(temperature=0.9, top_p=0.9, seed=7),
                                      dict(temperature=1.0, top_k=20, seed=11)],
                         ids=["greedy", "top_p-seed", "top_k-seed"])
def test_completion_equals_offline(client, llm, settings):
    prompt = "def add(a, b):"
    want = llm.generate(prompt, SamplingParams(max_tokens=12, **settings))[0]
    extra = {"top_k": settings.pop("top_k")} if "top_k" in settings else None
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                    extra_body=extra, **settings)
    assert got.object == "text_completion" and got.model == NAME
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompt_and_stop_string(client, llm):
    ids = llm.tokenizer.encode("for i in range(10):")
    free = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10))[0]
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0)
    assert got.choices[0].text == free.text
    stop = free.text[4:6]  # a stop string the greedy output is known to contain
    want = llm.generate({"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=10, stop=[stop]))[0]
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0,
                                    stop=[stop])
    assert want.finish_reason == "stop" and stop not in want.text
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")


def test_chat_equals_offline(client, llm):
    want = llm.chat(MESSAGES, SamplingParams(temperature=0.8, seed=3, max_tokens=10))[0]
    got = client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0.8,
                                         seed=3, max_completion_tokens=10)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        len(want.prompt_token_ids), len(want.token_ids))


def test_streaming_chat_equals_offline(client, llm):
    want = llm.chat(MESSAGES, SamplingParams(temperature=0.7, seed=5, max_tokens=14))[0]
    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, temperature=0.7, seed=5, max_tokens=14, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == want.text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    # include_usage: one last chunk with no choices and the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_streaming_completion_sse_ends_with_done(server, llm):
    want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0]
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": "Hello", "max_tokens": 8,
                            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_32_concurrent_streams_each_get_their_own_output(server, llm):
    n, max_tokens = 32, 4
    prompts = [f"Hello, {i}! How are you?" for i in range(n)]

    async def one(aclient, i):
        stream = await aclient.completions.create(model=NAME, prompt=prompts[i], seed=i,
                                                  temperature=1.0, max_tokens=max_tokens,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(n)))

    with ThreadPoolExecutor(1) as pool:  # the offline reference, while the server works
        offline = pool.submit(lambda: [
            llm.generate(p, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens))[0].text
            for i, p in enumerate(prompts)])
        got = asyncio.run(all_at_once())
        want = offline.result()
    assert got == want
    assert len(set(want)) > n // 2  # distinct requests, so a mix-up would show


# -- bad input --------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMPLETION = {"model": NAME, "prompt": "hi", "max_tokens": 2}
BAD = [
    # id, route, body (bytes are sent raw), status, param, words in the message
    ("malformed-json", CHAT, b'{"model": "tiny-chat",', 400, None, "not valid JSON"),
    ("body-not-object", COMPLETIONS, b"[1, 2]", 400, None, "JSON object"),
    ("missing-messages", CHAT, {"model": NAME}, 422, "messages", "messages: Field required"),
    ("empty-messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("message-without-role", CHAT, {**OK_CHAT, "messages": [{"content": "hi"}]}, 422,
     "messages[0].role", "Field required"),
    ("image-content", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content",
     "text parts"),
    ("missing-prompt", COMPLETIONS, {"model": NAME}, 422, "prompt", "prompt: Field required"),
    ("empty-prompt", COMPLETIONS, {**OK_COMPLETION, "prompt": ""}, 400, "prompt", "empty"),
    ("two-prompts", COMPLETIONS, {**OK_COMPLETION, "prompt": ["a", "b"]}, 400, "prompt",
     "one prompt per request"),
    ("token-id-out-of-vocab", COMPLETIONS, {**OK_COMPLETION, "prompt": [1, 10**6]}, 400,
     "prompt", "prompt_token_ids"),
    ("prompt-beyond-context", COMPLETIONS, {**OK_COMPLETION, "prompt": "hello world " * 400},
     400, "prompt", f"max_model_len is {MAX_LEN}"),
    ("negative-temperature", CHAT, {**OK_CHAT, "temperature": -0.5}, 400, "temperature",
     "temperature must be >= 0"),
    ("temperature-not-a-number", COMPLETIONS, {**OK_COMPLETION, "temperature": "hot"}, 422,
     "temperature", "valid number"),
    ("top_p-zero", CHAT, {**OK_CHAT, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top_p-above-one", COMPLETIONS, {**OK_COMPLETION, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("max_tokens-zero", COMPLETIONS, {**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens",
     ">= 1"),
    ("max_tokens-negative", CHAT, {**OK_CHAT, "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ("max_completion_tokens-zero", CHAT, {**OK_CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", ">= 1"),
    ("max_tokens-beyond-context", COMPLETIONS, {**OK_COMPLETION, "max_tokens": MAX_LEN}, 400,
     "max_tokens", "beyond the context"),
    ("n-two", CHAT, {**OK_CHAT, "n": 2}, 400, "n", "use n=1"),
    ("stream_options-without-stream", CHAT, {**OK_CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options", "stream=true"),
    ("seed-too-big", COMPLETIONS, {**OK_COMPLETION, "seed": 2**70}, 400, "seed", "seed"),
    ("unknown-model", CHAT, {**OK_CHAT, "model": "gpt-4"}, 404, "model", "`gpt-4` does not exist"),
]


@pytest.mark.parametrize("route,body,status,param,words", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, route, body, status, param, words):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{route}", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"], error["message"]
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}], ids=["none", "wrong", "no-bearer"])
def test_every_v1_route_needs_the_key(server, headers):
    for method, route, body in (("GET", "/v1/models", None), ("POST", CHAT, OK_CHAT),
                                ("POST", COMPLETIONS, b"not even json")):
        r = httpx.request(method, f"{server}{route}", headers=headers, timeout=30,
                          **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert r.status_code == 401, (route, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200  # not under /v1: no key
    assert httpx.get(f"{server}/metrics").status_code == 200


def test_openai_client_sees_typed_errors(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.UnprocessableEntityError, match="top_p"):
        client.completions.create(model=NAME, prompt="hi", extra_body={"top_p": [1]})


def test_unknown_routes_and_methods_answer_json(server):
    r = httpx.get(f"{server}/v1/engines", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.get(f"{server}{COMPLETIONS}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "error" in r.json()


def test_server_still_answers_after_bad_input(client, llm):
    want = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=5))[0]
    got = client.completions.create(model=NAME, prompt="The quick", max_tokens=5, temperature=0)
    assert got.choices[0].text == want.text


# -- metrics ----------------------------------------------------------------------------------

def test_metrics_parse_and_move(server, client):
    before = scrape(server)
    done = client.completions.create(model=NAME, prompt="import numpy", max_tokens=7,
                                     temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=9,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="", max_tokens=2)
    prompt_tokens = done.usage.prompt_tokens + chunks[-1].usage.prompt_tokens
    generated = done.usage.completion_tokens + chunks[-1].usage.completion_tokens

    def moved(name, labels=()):
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def settled():
        nonlocal after
        after = scrape(server)
        return moved("flashdraft_requests_total", {"route": CHAT, "status": "200"}.items()) == 1

    after = {}
    wait_for(settled, 10, "the request counters")
    assert moved("flashdraft_requests_total", {"route": COMPLETIONS, "status": "200"}.items()) == 1
    assert moved("flashdraft_requests_total", {"route": COMPLETIONS, "status": "400"}.items()) == 1
    assert moved("flashdraft_prompt_tokens_total") == prompt_tokens
    assert moved("flashdraft_generation_tokens_total") == generated
    for histogram in ("flashdraft_time_to_first_token_seconds",
                      "flashdraft_time_per_output_token_seconds", "flashdraft_tau",
                      "flashdraft_e2e_request_latency_seconds"):
        assert moved(f"{histogram}_count") == 2, histogram
    drafted = moved("flashdraft_draft_tokens_total")
    accepted = moved("flashdraft_accepted_tokens_total")
    assert 0 < accepted <= drafted  # the draft is the target itself: most drafts are accepted
    first = {"position": "1"}.items()
    assert 0 < moved("flashdraft_draft_position_accepted_total", first) \
        <= moved("flashdraft_draft_position_drafted_total", first)
    assert ("flashdraft_draft_position_drafted_total", (("position", str(K)),)) in after
    assert after[("flashdraft_queue_length", ())] == 0
    assert after[("flashdraft_requests_running", ())] == 0


# -- queueing and cancellation: a server in this process over a slowed-down engine ------------

class SlowLLM:
    """The real LLM, but each delta first waits for `gate` and then `delay` seconds, so that a
    request stays running for as long as a test needs; `fail_after` N deltas, it raises."""

    def __init__(self, llm: LLM, delay: float):
        self.llm, self.delay = llm, delay
        self.gate = threading.Event()
        self.gate.set()
        self.fail_after: int | None = None

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def stream(self, prompt, params):
        with contextlib.closing(self.llm.stream(prompt, params)) as deltas:
            for i, delta in enumerate(deltas):
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("an injected engine failure")
                if not self.gate.wait(30):
                    raise TimeoutError("the test never opened the gate")
                time.sleep(self.delay)
                yield delta


@pytest.fixture(scope="module")
def slow(tiny):
    """(url, SlowLLM, app) of a server with --max-queue 1 in a thread of this process."""
    slow_llm = SlowLLM(LLM(str(tiny), device="cpu"), delay=0.05)
    app = create_app(slow_llm, ServerSettings(served_model_name=NAME, max_queue=1))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the in-process server")
        yield f"http://127.0.0.1:{port}", slow_llm, app
    finally:
        slow_llm.gate.set()
        server.should_exit = True
        thread.join(15)


def test_full_queue_answers_503_with_retry_after(slow, llm):
    url, slow_llm, app = slow
    worker = app.state.worker
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    results = {}

    def ask(name, prompt):
        results[name] = client.completions.create(model=NAME, prompt=prompt, max_tokens=4,
                                                  temperature=0).choices[0].text

    slow_llm.gate.clear()  # the running request holds before its first token
    threads = [threading.Thread(target=ask, args=("running", "Hello"))]
    threads[0].start()
    wait_for(lambda: worker.running is not None, 20, "the first request to start")
    threads.append(threading.Thread(target=ask, args=("queued", "The quick")))
    threads[1].start()
    wait_for(lambda: worker.queue.qsize() == 1, 20, "the second request to queue")
    try:
        r = httpx.post(f"{url}{COMPLETIONS}", json={**OK_COMPLETION, "model": NAME}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        slow_llm.gate.set()
        for t in threads:
            t.join(60)
    plain = lambda p: llm.generate(p, SamplingParams(temperature=0, max_tokens=4),
                                   draft=None)[0].text
    assert results == {"running": plain("Hello"), "queued": plain("The quick")}


def test_client_gone_while_queued_is_skipped(slow):
    url, slow_llm, app = slow
    worker = app.state.worker
    count = lambda name, labels=(): scrape(url).get((name, labels), 0.0)
    before = {name: count(name) for name in ("flashdraft_prompt_tokens_total",
                                             "flashdraft_generation_tokens_total")}
    cancelled = count("flashdraft_request_finished_total", (("finish_reason", "cancelled"),))
    slow_llm.gate.clear()
    running = threading.Thread(target=httpx.post, args=(f"{url}{COMPLETIONS}",),
                               kwargs={"json": {**OK_COMPLETION, "ignore_eos": True},
                                       "timeout": 60})
    running.start()
    try:
        wait_for(lambda: worker.running is not None, 20, "the first request to start")
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while queued
            httpx.post(f"{url}{COMPLETIONS}", json={**OK_COMPLETION, "prompt": "The quick"},
                       timeout=1)
        wait_for(lambda: worker.queue.queue[0].cancelled, 10, "the queued job to be cancelled")
    finally:
        slow_llm.gate.set()
        running.join(60)
    wait_for(lambda: worker.queue.qsize() == 0 and worker.running is None, 20, "an idle worker")
    prompt_tokens = len(slow_llm.llm.tokenizer.encode(OK_COMPLETION["prompt"]))
    assert count("flashdraft_prompt_tokens_total") - before["flashdraft_prompt_tokens_total"] \
        == prompt_tokens  # the first request's only: the second never reached the engine
    assert count("flashdraft_generation_tokens_total") \
        - before["flashdraft_generation_tokens_total"] == OK_COMPLETION["max_tokens"]
    assert count("flashdraft_request_finished_total",
                 (("finish_reason", "cancelled"),)) == cancelled + 1


def test_dropped_stream_is_cancelled_and_does_not_stall_the_next(slow, llm):
    url, slow_llm, app = slow
    cancelled = lambda: scrape(url).get(
        ("flashdraft_request_finished_total", (("finish_reason", "cancelled"),)), 0.0)
    before = cancelled()
    # 400 tokens at >= 50 ms each: the dropped request alone would hold the engine for 20 s.
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=30) as r:
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
    assert len(received) >= 3  # the role chunk and some text, then the client hangs up

    start = time.monotonic()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    got = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert time.monotonic() - start < 10
    want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), draft=None)[0]
    assert got.choices[0].text == want.text
    assert cancelled() == before + 1


def test_engine_failure_is_a_json_500_and_the_server_goes_on(slow, llm):
    url, slow_llm, app = slow
    try:
        slow_llm.fail_after = 0
        r = httpx.post(f"{url}{COMPLETIONS}", json=OK_COMPLETION, timeout=30)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "injected engine failure" in r.json()["error"]["message"]
        slow_llm.fail_after = 2  # mid-stream: the status is sent, so the error is an event
        with httpx.stream("POST", f"{url}{CHAT}", timeout=30,
                          json={**OK_CHAT, "max_tokens": 8, "ignore_eos": True,
                                "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert "injected engine failure" in json.loads(events[-2])["error"]["message"]
    finally:
        slow_llm.fail_after = None
    assert app.state.worker.alive()
    got = httpx.post(f"{url}{COMPLETIONS}", json={**OK_COMPLETION, "temperature": 0},
                     timeout=30).json()
    want = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2), draft=None)[0]
    assert got["choices"][0]["text"] == want.text


def test_the_worker_saves_the_step_costs_when_it_stops():
    """Shutting the server down closes the LLM (its step costs saved for the next start) on
    the engine's own thread, after its last step; a failure to save is logged, not raised."""
    from flashdraft.serving.server import ServerMetrics, Worker

    class Closing:
        closed = 0

        def close(self):
            self.closed += 1
            raise OSError("read-only cache directory")

    llm = Closing()
    worker = Worker(llm, max_queue=1, metrics=ServerMetrics())
    worker.start()
    worker.stop()
    assert not worker.alive() and llm.closed == 1
