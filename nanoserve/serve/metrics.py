"""/metrics: the server's numbers in Prometheus' text format, via prometheus_client.

This module owns `ServerMetrics`, one `CollectorRegistry` of the server's
gauges, counters and histograms (a registry per server, not the library's
global one, so two servers in one process, as in the tests, keep apart):

    nanoserve_requests{state="running"|"waiting"|"swapped"}      after each step
    nanoserve_kv_blocks{state="used"|"cached"|"free"}            used: held by requests; cached: only by the
                                                                 prefix cache (evictable); free: free queue
    nanoserve_prefix_cache_hit_rate                              prompt tokens whose KV came from the cache,
                                                                 since the engine started
(the blocks and the hit rate are counted by kv_usage.py, as the TUI counts them)
    nanoserve_tokens_per_second                                  prefill + decode tokens, last 10 s
    nanoserve_prompt_tokens_total, nanoserve_generation_tokens_total, nanoserve_steps_total
    nanoserve_requests_finished_total{finish_reason}, nanoserve_requests_rejected_total (429)
    nanoserve_time_to_first_token_seconds                        histogram: arrival at the server -> first token
    nanoserve_inter_token_latency_seconds                        histogram: between a completion's tokens
    nanoserve_e2e_request_latency_seconds                        histogram: arrival -> finish

Everything is updated on the engine thread (prometheus_client's metrics are
thread-safe); the /metrics route only renders the registry.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from nanoserve.kv_usage import CACHED, FREE, HIT_RATE, USED, hit_rate, kv_usage

# Latency buckets from 1 ms to a minute: tiny models answer in milliseconds, a CPU 135M model in seconds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Gauge("nanoserve_requests", "Requests in each engine queue", ["state"], registry=r)
        self.kv_blocks = Gauge("nanoserve_kv_blocks", f"KV blocks. used: {USED}; cached: {CACHED}; free: {FREE}",
                               ["state"], registry=r)
        self.hit_rate = Gauge("nanoserve_prefix_cache_hit_rate", f"Prefix cache hit rate: {HIT_RATE}", registry=r)
        self.tokens_per_s = Gauge("nanoserve_tokens_per_second",
                                  f"Prefill + decode tokens computed per second over the last {RATE_WINDOW_S:g} s",
                                  registry=r)
        self.prompt_tokens = Counter("nanoserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("nanoserve_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter("nanoserve_steps", "Engine steps", registry=r)
        self.finished = Counter("nanoserve_requests_finished", "Requests finished, by reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("nanoserve_requests_rejected", "Requests refused with 429: the waiting queue was full",
                                registry=r)
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds", "Arrival at the server to the first token",
                              buckets=BUCKETS, registry=r)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds", "Time between two tokens of a completion",
                             buckets=BUCKETS, registry=r)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds", "Arrival at the server to the last token",
                             buckets=BUCKETS, registry=r)
        for state in ("running", "waiting", "swapped"):
            self.requests.labels(state).set(0)
        # Per unfinished request (engine thread only): arrival time, whether its first token came,
        # and per completion index (tokens seen, time of the latest).
        self._live: dict[str, tuple[float, bool, dict[int, tuple[int, float]]]] = {}
        self._window: deque[tuple[float, int]] = deque()   # (time, tokens computed in that step)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- engine thread ---------------------------------------------------------------------

    def admitted(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self._live[request_id] = (arrival, False, {})

    def aborted(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.finished.labels("abort").inc()

    def after_step(self, engine, result, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        stats = result.stats
        self.steps.inc()
        self.requests.labels("running").set(stats.num_running)
        self.requests.labels("waiting").set(stats.num_waiting)
        self.requests.labels("swapped").set(stats.num_swapped)
        usage = kv_usage(engine.pool.num_blocks, engine.pool.num_free_blocks,
                         engine.radix.num_evictable_blocks if engine.radix is not None else 0)
        for state in ("used", "cached", "free"):
            self.kv_blocks.labels(state).set(getattr(usage, state))
        cache = engine.prefix_cache_stats()
        rate = hit_rate(cache["num_hit_tokens"], cache["num_lookup_tokens"])
        self.hit_rate.set(rate if rate is not None else 0.0)
        self._window.append((now, stats.num_prefill_tokens + stats.num_decode_tokens))
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        span = max(now - self._window[0][0], stats.duration_s, 1e-9)
        self.tokens_per_s.set(sum(n for _, n in self._window) / span)
        for out in result.outputs:
            self._observe(out, now)

    def _observe(self, out, now: float) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        arrival, started, seen = live
        for c in out.outputs:
            count, last = seen.get(c.index, (0, None))
            new = len(c.token_ids) - count
            if new <= 0:
                continue
            self.generation_tokens.inc(new)
            if not started:                    # the request's first token, whichever completion has it
                self.ttft.observe(now - arrival)
                started = True
            if last is not None:               # the gap since this completion's previous token, split over
                gap = (now - last) / new       # the tokens it brought (several in a step with speculation)
                for _ in range(new):
                    self.itl.observe(gap)
            seen[c.index] = (len(c.token_ids), now)
        self._live[out.request_id] = (arrival, started, seen)
        if out.finished:
            del self._live[out.request_id]
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
            self.finished.labels(reason).inc()
            self.e2e.observe(now - arrival)
