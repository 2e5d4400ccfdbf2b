"""No request and no subscriber stops the server's engine thread.

Failures are injected at each stage a request goes through (tokenizing its prompt, adding it to
the engine, a subscriber on its events, the step computing it, the metrics after the step, an
/events watcher, the --record trace filling the disk), and text that is not valid Unicode (a
lone surrogate: "\\ud800" is valid JSON) comes in at every field that reaches the engine or a
viewer. Each time the request concerned gets an answer naming the cause, the engine loop goes
on, /health stays truthful (200 while it runs; 503 only for an engine that cannot step again),
the next request is served, and the engine ends clean. Before these fixes, each of them ended
the engine thread: every later request got 503 until a restart.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import FullDisk
from serve_helpers import check_clean, on_engine, running_server, save_chat_model, wait_idle

from nanoserve import events as ev
from nanoserve.errors import EngineBroken
from nanoserve.models.loader import load_model
from nanoserve.trace_check import load_trace

CONFIG = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(save_chat_model(tmp_path_factory.mktemp("chat-llama")))


@pytest.fixture
def server(loaded):
    with running_server(loaded, CONFIG) as (url, srv):
        yield url, srv


def post(url: str, body: dict | str, path: str = "/v1/completions", timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)


def completion(model: str, prompt="Hello", **fields) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, **fields}


def still_serving(url: str, srv, model: str) -> None:
    """/health says ok, a request is served, and the engine is clean."""
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    resp = post(url, completion(model))
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length", resp.text
    assert srv.engine_loop.alive and srv.engine_loop.error is None
    wait_idle(srv)
    check_clean(srv)


def assert_error(resp: httpx.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error


# -- text that is not valid Unicode, at the edge ------------------------------------------------

SURROGATE_BODIES = {   # field -> a body with a lone surrogate there
    "prompt": lambda m: completion(m, prompt="hi \ud800"),
    "messages.0.content": lambda m: {"model": m, "messages": [{"role": "user", "content": "a\udfff"}]},
    "user": lambda m: completion(m, user="\ud83d"),
    "stop.0": lambda m: completion(m, stop=["\udc80"]),
    "model": lambda m: completion("\ud800" + m),
}


@pytest.mark.parametrize("field", list(SURROGATE_BODIES))
def test_a_lone_surrogate_is_a_400_naming_its_field(server, loaded, field):
    url, srv = server
    body = SURROGATE_BODIES[field](loaded.name)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = post(url, json.dumps(body), path)        # json.dumps writes the surrogate as \\udXXX: valid JSON
    assert_error(resp, 400, "not valid Unicode text", "lone surrogate")
    assert resp.json()["error"]["param"] == field
    assert httpx.get(url + "/clients", timeout=30).status_code == 200
    still_serving(url, srv, loaded.name)


@pytest.mark.parametrize("field, body", [
    ("prompt", {"prompt": "hi \ud800"}),
    ("messages.0.content", {"messages": [{"role": "user", "content": "a\udfff"}]}),
])
def test_the_tokenize_route_refuses_a_lone_surrogate(server, loaded, field, body):
    """vLLM's POST /tokenize checks its text at the edge too (it was a 500 from the tokenizer)."""
    url, srv = server
    resp = post(url, json.dumps(body), "/tokenize")
    assert_error(resp, 400, "not valid Unicode text", "lone surrogate")
    assert resp.json()["error"]["param"] == field
    still_serving(url, srv, loaded.name)


@pytest.mark.parametrize("prompt, field", [
    ([2962664876665427, -1846, 3, 1], "prompt"),
    ([[1, 2], [3, 10**12]], "prompt.1"),
])
def test_echo_of_token_ids_outside_the_vocabulary_is_a_400(server, loaded, prompt, field):
    """Found by the server fuzz: an echoed prompt of token ids was decoded before the engine checked
    its ids, and the tokenizer's OverflowError was a 500."""
    url, srv = server
    resp = post(url, completion(loaded.name, prompt=prompt, echo=True))
    assert_error(resp, 400, "outside the vocabulary")
    assert resp.json()["error"]["param"] == field
    still_serving(url, srv, loaded.name)


def test_the_clients_stream_survives_a_bad_user_field(server, loaded):
    """The TUI's attach reads /events?clients=1: a bad `user` must not cut it."""
    url, srv = server
    with httpx.stream("GET", url + "/events?clients=1", timeout=30) as stream:
        lines = stream.iter_lines()
        assert any(line.startswith("data: ") for line in _take(lines, 5))
        post(url, json.dumps(completion(loaded.name, user="\ud800")))
        post(url, completion(loaded.name, user="alice"))
        seen = "".join(_until(lines, lambda line: "alice" in line))
        assert "alice" in seen
    still_serving(url, srv, loaded.name)


def _take(lines, n):
    return [next(lines) for _ in range(n)]


def _until(lines, done, limit: int = 10_000):
    for _ in range(limit):
        line = next(lines)
        yield line
        if done(line):
            return


# -- failures injected at each stage ---------------------------------------------------------------

class Tokenizer:
    """The engine's tokenizer, raising (or waiting) for one marked prompt."""

    def __init__(self, real, marker: str, exc: Exception | None = None, gate: threading.Event | None = None):
        self.real, self.marker, self.exc, self.gate = real, marker, exc, gate
        self.waiting = threading.Event()

    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and self.marker in text:
            if self.gate is not None:
                self.waiting.set()
                self.gate.wait(60)
            if self.exc is not None:
                raise self.exc
        return self.real(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_tokenizing_raises(server, loaded, monkeypatch):
    url, srv = server
    monkeypatch.setattr(srv.engine, "tokenizer", Tokenizer(srv.engine.tokenizer, "BOOM", TypeError("injected")))
    assert_error(post(url, completion(loaded.name, prompt="BOOM")), 500, "TypeError: injected")
    still_serving(url, srv, loaded.name)


def test_add_request_raises(server, loaded, monkeypatch):
    url, srv = server
    add = srv.engine.add_request

    def add_request(request_id, prompt, *args, **kwargs):
        if prompt == "BOOM":
            raise RuntimeError("injected: add_request")
        return add(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(srv.engine, "add_request", add_request)
    assert_error(post(url, completion(loaded.name, prompt="BOOM")), 500, "RuntimeError: injected: add_request")
    still_serving(url, srv, loaded.name)


def test_a_subscriber_raises_on_every_event(server, loaded):
    """The engine completes each operation and raises SubscriberError after it: requests still finish."""
    url, srv = server

    def broken(event):
        if not isinstance(event, ev.EngineSynced):
            raise RuntimeError("injected: a broken viewer")

    unsubscribe = on_engine(srv, lambda e: e.subscribe(broken))
    try:
        before = srv.engine_loop.failures
        resp = post(url, completion(loaded.name))
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert srv.engine_loop.failures > before
    finally:
        on_engine(srv, lambda e: unsubscribe())
    still_serving(url, srv, loaded.name)


def test_a_step_fails(server, loaded, monkeypatch):
    """The forward raises once: the engine undid the step; its request gets a 500 with the cause."""
    url, srv = server
    run = srv.engine.runner.run
    armed = {"left": 1}

    def flaky(batch):
        if armed["left"]:
            armed["left"] -= 1
            raise RuntimeError("injected: the device went away")
        return run(batch)

    monkeypatch.setattr(srv.engine.runner, "run", flaky)
    assert_error(post(url, completion(loaded.name)), 500, "RuntimeError: injected: the device went away")
    still_serving(url, srv, loaded.name)


def test_the_metrics_and_an_events_watcher_fail(server, loaded, monkeypatch):
    from nanoserve.serve.event_stream import Watcher

    url, srv = server
    monkeypatch.setattr(srv.metrics, "after_step", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(Watcher, "flush", lambda self: 1 / 0)
    with httpx.stream("GET", url + "/events", timeout=30) as stream:
        resp = post(url, completion(loaded.name))
        assert resp.status_code == 200
        assert list(stream.iter_lines()) is not None        # the stream ends (closed); nothing hangs
    monkeypatch.undo()
    still_serving(url, srv, loaded.name)


def test_record_onto_a_full_disk(loaded, tmp_path):
    trace = tmp_path / "serve.jsonl"
    with running_server(loaded, CONFIG, record=trace) as (url, srv):
        assert post(url, completion(loaded.name)).status_code == 200
        srv._recorder._file = FullDisk(srv._recorder._file, room=300)    # fills half way through a line
        for _ in range(3):
            assert post(url, completion(loaded.name)).status_code == 200
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "ok" and "No space left on device" in health["record"]
        still_serving(url, srv, loaded.name)
    events = load_trace(trace)                      # whole lines only: no repair needed, the check passes
    assert isinstance(events[0], ev.EngineSynced) and len(events) == srv._recorder.lines


def test_record_onto_dev_full_serves_anyway(loaded):
    with running_server(loaded, CONFIG, record="/dev/full") as (url, srv):
        assert "No space left" in httpx.get(url + "/health", timeout=30).json()["record"]
        still_serving(url, srv, loaded.name)


def test_tokenizing_happens_off_the_engine_thread(server, loaded, monkeypatch):
    """A huge prompt still being tokenized holds no one else: a short request is served meanwhile
    (and the huge one is refused once counted: it does not fit the context)."""
    from nanoserve.serve.engine_loop import LONG_PROMPT_CHARS

    url, srv = server
    gate = threading.Event()
    tokenizer = Tokenizer(srv.engine.tokenizer, "SLOW", gate=gate)
    monkeypatch.setattr(srv.engine, "tokenizer", tokenizer)
    slow: dict = {}
    huge = "SLOW " + "a" * LONG_PROMPT_CHARS
    thread = threading.Thread(target=lambda: slow.update(resp=post(url, completion(loaded.name, prompt=huge))))
    thread.start()
    try:
        assert tokenizer.waiting.wait(30)
        resp = post(url, completion(loaded.name, prompt=[1, 2, 3]), timeout=30)
        assert resp.status_code == 200 and not slow        # served while the slow prompt is still tokenized
    finally:
        gate.set()
        thread.join(60)
    assert_error(slow["resp"], 400, "maximum context length is 128")
    still_serving(url, srv, loaded.name)


def test_the_tokenize_route_tokenizes_off_the_engine_thread(server, loaded, monkeypatch):
    """POST /tokenize of a huge text holds no one up: a completion is served while it is tokenized
    (it was tokenized on the engine thread, between two steps, so every request waited for it)."""
    from nanoserve.serve.engine_loop import LONG_PROMPT_CHARS

    url, srv = server
    gate = threading.Event()
    tokenizer = Tokenizer(srv.engine.tokenizer, "SLOW", gate=gate)
    monkeypatch.setattr(srv, "tokenizer", tokenizer)
    slow: dict = {}
    huge = "SLOW " + "a" * LONG_PROMPT_CHARS
    thread = threading.Thread(target=lambda: slow.update(resp=post(url, {"prompt": huge}, "/tokenize")))
    thread.start()
    try:
        assert tokenizer.waiting.wait(30)
        resp = post(url, completion(loaded.name, prompt=[1, 2, 3]), timeout=15)
        assert resp.status_code == 200 and not slow        # served while the huge text is still tokenized
    finally:
        gate.set()
        thread.join(60)
    assert slow["resp"].status_code == 200 and slow["resp"].json()["count"] > LONG_PROMPT_CHARS // 8
    still_serving(url, srv, loaded.name)


def test_an_engine_that_cannot_step_again_makes_health_say_so(loaded, monkeypatch):
    with running_server(loaded, CONFIG) as (url, srv):
        def broken(batch):
            raise EngineBroken("injected: a worker process died")

        monkeypatch.setattr(srv.engine.runner, "run", broken)
        assert_error(post(url, completion(loaded.name)), 500, "EngineBroken")
        deadline = time.monotonic() + 30
        while srv.engine_loop.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and "EngineBroken" in health.json()["error"]
        assert_error(post(url, completion(loaded.name)), 503, "not running")


def test_shutting_down_ends_running_requests_with_a_503_not_a_cut_stream(loaded):
    """Stopping the server while requests still generate: after the grace period each gets a 503 that
    says why (a stream as its last event, then [DONE]); uvicorn never has to cancel a handler."""
    from nanoserve import EngineConfig, LLMEngine
    from nanoserve.serve.app import build_app
    from nanoserve.serve.background import BackgroundServer

    engine = LLMEngine(EngineConfig(model=loaded.name, **CONFIG), loaded=loaded)
    app = build_app(engine, step_delay=0.1)            # 120 tokens take 12 s: longer than the 5 s grace
    body = completion(loaded.name, max_tokens=120, ignore_eos=True)
    lines: list[str] = []
    whole: list[httpx.Response] = []
    with BackgroundServer(app) as background:
        def stream():
            with httpx.stream("POST", background.url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as resp:
                lines.extend(line for line in resp.iter_lines() if line.startswith("data: "))

        readers = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: whole.append(post(background.url, body)))]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 30
        while len(app.state.server.engine_loop._sinks) < 2:      # both admitted and running
            assert time.monotonic() < deadline, "the requests were not admitted"
            time.sleep(0.05)
        background.stop()
        for t in readers:
            t.join(30)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error", error
    assert len(lines) > 3                                        # it streamed tokens before that
    assert whole and whole[0].status_code == 503 and "shutting down" in whole[0].json()["error"]["message"]
