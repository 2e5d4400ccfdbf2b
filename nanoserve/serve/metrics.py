"""/metrics: the server's numbers in Prometheus' text format, via prometheus_client.

This module owns `ServerMetrics`, one `CollectorRegistry` of the server's
gauges, counters and histograms (a registry per server, not the library's
global one, so two servers in one process, as in the tests, keep apart).
Every series carries a `model_name` label (the served name), as vLLM's do, so
one dashboard can show several servers:

    gauges       nanoserve_requests{state="running"|"waiting"|"swapped"}   sequences in each queue
                 nanoserve_kv_blocks{state="used"|"cached"|"free"}   used: held by requests; cached: only by
                                                                     the prefix cache (evictable); free
                 nanoserve_kv_cache_usage_perc            used blocks / all blocks (0..1)
                 nanoserve_prefix_cache_hit_rate          lifetime: hit tokens / looked-up tokens
                 (the blocks and the hit rate are counted by kv_usage.py, as the TUI counts them)
                 nanoserve_tokens_per_second              prefill + decode tokens, last 10 s
    counters     nanoserve_prompt_tokens_total, nanoserve_generation_tokens_total, nanoserve_steps_total
                 nanoserve_requests_finished_total{finish_reason}, nanoserve_requests_rejected_total (429)
                 nanoserve_preemptions_total
                 nanoserve_spec_decode_drafted_total, nanoserve_spec_decode_accepted_total   (draft tokens)
                 nanoserve_prefix_cache_queries_total, nanoserve_prefix_cache_hits_total    (tokens)
    histograms   nanoserve_iteration_tokens               tokens computed per step (chunked prefill's budget)
                 nanoserve_time_to_first_token_seconds    arrival at the server -> first token
                 nanoserve_inter_token_latency_seconds    between a completion's tokens
                 nanoserve_e2e_request_latency_seconds    arrival -> finish
                 nanoserve_request_queue_time_seconds     arrival -> first scheduled (waiting for a seat)
                 nanoserve_request_prefill_time_seconds   first scheduled -> first token
                 nanoserve_request_decode_time_seconds    first token -> finish

docs/serve.md maps each to vLLM's name. Everything is updated on the engine
thread (prometheus_client's metrics are thread-safe): `after_step` after every
step, `refresh` (the gauges and the prefix-cache counters, from the engine's
state) also when the loop is idle, so an abort with no step after it still
shows; the /metrics route only renders the registry.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from nanoserve import events as ev
from nanoserve.kv_usage import CACHED, FREE, HIT_RATE, USED, hit_rate, kv_usage

# Latency buckets from 1 ms to a minute: tiny models answer in milliseconds, a CPU 135M model in seconds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # vLLM's, for tokens per step
RATE_WINDOW_S = 10.0


@dataclass(slots=True)
class _Live:
    """An unfinished request, as the metrics follow it."""

    arrival: float                       # time.monotonic() at the server
    scheduled: float | None = None       # the start of the step that first ran it
    first_token: float | None = None
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)   # completion -> (tokens, time of last)


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def gauge(name, doc, labels=()):
            return Gauge(name, doc, [*m, *labels], registry=r)

        def counter(name, doc, labels=()):
            return Counter(name, doc, [*m, *labels], registry=r)

        def histogram(name, doc, buckets=BUCKETS):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.requests = gauge("nanoserve_requests", "Sequences in each engine queue", ["state"])
        self.kv_blocks = gauge("nanoserve_kv_blocks", f"KV blocks. used: {USED}; cached: {CACHED}; free: {FREE}",
                               ["state"])
        self.kv_usage = gauge("nanoserve_kv_cache_usage_perc", "Share of KV blocks held by requests (0..1)")
        self.hit_rate = gauge("nanoserve_prefix_cache_hit_rate", f"Prefix cache hit rate: {HIT_RATE}")
        self.tokens_per_s = gauge("nanoserve_tokens_per_second",
                                  f"Prefill + decode tokens computed per second over the last {RATE_WINDOW_S:g} s")
        self.prompt_tokens = counter("nanoserve_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("nanoserve_generation_tokens", "Tokens generated")
        self.steps = counter("nanoserve_steps", "Engine steps")
        self.finished = counter("nanoserve_requests_finished", "Requests finished, by reason", ["finish_reason"])
        self.rejected = counter("nanoserve_requests_rejected", "Requests refused with 429: the waiting queue was full")
        self.preemptions = counter("nanoserve_preemptions", "Sequences preempted (recompute or swap)")
        self.drafted = counter("nanoserve_spec_decode_drafted", "Speculative decoding: draft tokens verified")
        self.accepted = counter("nanoserve_spec_decode_accepted", "Speculative decoding: draft tokens accepted")
        self.cache_queries = counter("nanoserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.cache_hits = counter("nanoserve_prefix_cache_hits", "Prompt tokens whose KV the prefix cache had")
        self.iteration_tokens = histogram("nanoserve_iteration_tokens", "Tokens computed per engine step",
                                          TOKEN_BUCKETS)
        self.ttft = histogram("nanoserve_time_to_first_token_seconds", "Arrival at the server to the first token")
        self.itl = histogram("nanoserve_inter_token_latency_seconds", "Time between two tokens of a completion")
        self.e2e = histogram("nanoserve_e2e_request_latency_seconds", "Arrival at the server to the last token")
        self.queue_time = histogram("nanoserve_request_queue_time_seconds",
                                    "Arrival at the server to the start of the step that first ran it")
        self.prefill_time = histogram("nanoserve_request_prefill_time_seconds",
                                      "The start of the step that first ran it to its first token")
        self.decode_time = histogram("nanoserve_request_decode_time_seconds", "First token to the last")
        for state in ("running", "waiting", "swapped"):
            self.requests.labels(model_name, state).set(0)
        for metric in (self.prompt_tokens, self.generation_tokens, self.steps, self.rejected, self.preemptions,
                       self.drafted, self.accepted, self.cache_queries, self.cache_hits):
            metric.labels(model_name)   # (a series at 0 from the start, as a dashboard expects)
        self._live: dict[str, _Live] = {}   # unfinished requests (engine thread only)
        self._window: deque[tuple[float, int]] = deque()   # (time, tokens computed in that step)
        self._cache_seen = (0, 0)           # the engine's prefix-cache (lookup, hit) tokens already counted

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _inc(self, counter: Counter, amount: float = 1, *labels: str) -> None:
        if amount:
            counter.labels(self.model_name, *labels).inc(amount)

    # -- engine thread ---------------------------------------------------------------------

    def admitted(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._inc(self.prompt_tokens, num_prompt_tokens)
        self._live[request_id] = _Live(arrival)

    def rejected_request(self) -> None:
        self._inc(self.rejected)

    def aborted(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self._inc(self.finished, 1, "abort")

    def refresh(self, engine) -> None:
        """The gauges and the prefix-cache counters, from the engine's state now (between two steps)."""
        name, scheduler, pool = self.model_name, engine.scheduler, engine.pool
        self.requests.labels(name, "running").set(len(scheduler.running))
        self.requests.labels(name, "waiting").set(len(scheduler.waiting))
        self.requests.labels(name, "swapped").set(len(scheduler.swapped))
        usage = kv_usage(pool.num_blocks, pool.num_free_blocks,           # counted as the TUI counts them
                         engine.kv.num_available_blocks - pool.num_free_blocks)   # (KV cache groups: companions too)
        for state in ("used", "cached", "free"):
            self.kv_blocks.labels(name, state).set(getattr(usage, state))
        self.kv_usage.labels(name).set(usage.used / pool.num_blocks)
        stats = engine.prefix_cache_stats()
        looked, hit = stats["num_lookup_tokens"], stats["num_hit_tokens"]
        rate = hit_rate(hit, looked)
        self.hit_rate.labels(name).set(rate if rate is not None else 0.0)
        self._inc(self.cache_queries, looked - self._cache_seen[0])
        self._inc(self.cache_hits, hit - self._cache_seen[1])
        self._cache_seen = (looked, hit)

    def after_step(self, engine, result, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        stats = result.stats
        self._inc(self.steps)
        self._inc(self.preemptions, stats.num_preempted)
        self._inc(self.drafted, stats.num_drafted)
        self._inc(self.accepted, stats.num_accepted)
        self.refresh(engine)
        computed = stats.num_prefill_tokens + stats.num_decode_tokens
        if computed:
            self.iteration_tokens.observe(computed)
        self._window.append((now, computed))
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        span = max(now - self._window[0][0], stats.duration_s, 1e-9)
        self.tokens_per_s.labels(self.model_name).set(sum(n for _, n in self._window) / span)
        started = now - stats.duration_s                 # when this step began
        for e in result.events:
            if isinstance(e, ev.SequenceAdmitted) and e.seq_id in self._live:   # (a request's first sequence)
                live = self._live[e.seq_id]
                if live.scheduled is None:               # (not again after a preemption)
                    live.scheduled = started
                    self.queue_time.observe(started - live.arrival)
        for out in result.outputs:
            self._observe(out, now)

    def _observe(self, out, now: float) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        for c in out.outputs:
            count, last = live.seen.get(c.index, (0, None))
            new = len(c.token_ids) - count
            if new <= 0:
                continue
            self._inc(self.generation_tokens, new)
            if live.first_token is None:         # the request's first token, whichever completion has it
                live.first_token = now
                self.ttft.observe(now - live.arrival)
                self.prefill_time.observe(now - (live.scheduled if live.scheduled is not None else live.arrival))
            if last is not None:                 # the gap since this completion's previous token, split over
                gap = (now - last) / new         # the tokens it brought (several in a step with speculation)
                for _ in range(new):
                    self.itl.observe(gap)
            live.seen[c.index] = (len(c.token_ids), now)
        if out.finished:
            del self._live[out.request_id]
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
            self._inc(self.finished, 1, reason)
            self.e2e.observe(now - live.arrival)
            if live.first_token is not None:
                self.decode_time.observe(now - live.first_token)
