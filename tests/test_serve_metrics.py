"""/metrics for a dashboard: gauges that follow the engine even when no step comes (a hang-up), counters
equal to what the engine counted (preemptions, speculative drafts, prefix-cache lookups), the
tokens-per-step histogram equal to the steps' own numbers, per-request queue / prefill / decode times,
and the served name as a `model_name` label on every series."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import CONFIG, on_engine, running_server, wait_idle

from nanoserve import events as ev

NAME = "served-name"


def scrape(url: str) -> dict:
    """sample name + its labels other than model_name -> value; asserts model_name is on every sample."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == NAME, f"{s.name} has no model_name={NAME!r} label"
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def gauges_of(engine) -> dict:
    cached = engine.radix.num_evictable_blocks if engine.radix else 0
    used = engine.pool.num_used_blocks - cached
    return {("nanoserve_requests", (("state", "running"),)): len(engine.scheduler.running),
            ("nanoserve_requests", (("state", "waiting"),)): len(engine.scheduler.waiting),
            ("nanoserve_kv_blocks", (("state", "used"),)): used,
            ("nanoserve_kv_blocks", (("state", "cached"),)): cached,
            ("nanoserve_kv_cache_usage_perc", ()): used / engine.pool.num_blocks}


def test_gauges_follow_a_hang_up_that_no_step_follows(tiny_llama):
    """The client hangs up mid-stream; the engine aborts the request and goes idle. /metrics must say so
    (it used to keep `running 1` and the request's blocks until the next step, which never came)."""
    with running_server(tiny_llama, model_name=NAME) as (url, srv):
        body = {"model": NAME, "prompt": "Hang up on me", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            for _ in range(10):                        # it runs (ten steps' chunks: /metrics has seen a step) ...
                next(line for line in lines if line.startswith("data: "))
            running = scrape(url)[("nanoserve_requests", (("state", "running"),))]
        # ... and the client is gone
        wait_idle(srv)
        want = on_engine(srv, gauges_of)
        assert want[("nanoserve_requests", (("state", "running"),))] == 0 and running == 1
        deadline = time.monotonic() + 10
        while (got := {k: v for k, v in scrape(url).items() if k in want}) != want:
            assert time.monotonic() < deadline, f"/metrics {got} never agreed with the engine {want}"
            time.sleep(0.05)


def test_counters_and_histograms_equal_the_engines_numbers(tiny_llama):
    config = dict(block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16,
                  speculative_method="ngram", num_speculative_tokens=3)
    with running_server(tiny_llama, config, model_name=NAME) as (url, srv):
        seen = {"preempted": 0, "steps": 0, "tokens": []}

        def count(e):
            if isinstance(e, ev.Preempted):
                seen["preempted"] += 1
            elif isinstance(e, ev.StepFinished):
                seen["tokens"].append(e.num_prefill_tokens + e.num_decode_tokens)
        on_engine(srv, lambda engine: engine.subscribe(count))
        prompts = [[5, 6, 7] * 6 + [i] for i in range(6)]       # repeats for n-gram drafts, a shared prefix

        def send(prompt):
            httpx.post(url + "/v1/completions", timeout=120, json={"model": NAME, "prompt": prompt, "max_tokens": 40,
                                                                  "ignore_eos": True, "temperature": 0})
        threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_idle(srv)
        spec, cache = on_engine(srv, lambda e: (e.spec_stats(), e.prefix_cache_stats()))
        deadline = time.monotonic() + 10
        while (m := scrape(url))[("nanoserve_prefix_cache_queries_total", ())] != cache["num_lookup_tokens"]:
            assert time.monotonic() < deadline, "the prefix-cache counters never caught up"
            time.sleep(0.05)
    assert seen["preempted"] > 0 and spec["num_drafted"] > 0 and cache["num_hit_tokens"] > 0, \
        "the settings were meant to preempt, draft and hit the prefix cache"
    assert m[("nanoserve_preemptions_total", ())] == seen["preempted"]
    assert m[("nanoserve_spec_decode_drafted_total", ())] == spec["num_drafted"]
    assert m[("nanoserve_spec_decode_accepted_total", ())] == spec["num_accepted"]
    assert m[("nanoserve_prefix_cache_hits_total", ())] == cache["num_hit_tokens"]
    computed = [n for n in seen["tokens"] if n]
    assert m[("nanoserve_iteration_tokens_count", ())] == len(computed)
    assert m[("nanoserve_iteration_tokens_sum", ())] == sum(computed)
    assert m[("nanoserve_steps_total", ())] == len(seen["tokens"])
    for name in ("queue_time", "prefill_time", "decode_time"):
        assert m[(f"nanoserve_request_{name}_seconds_count", ())] == len(prompts), name
    assert m[("nanoserve_requests_finished_total", (("finish_reason", "length"),))] == len(prompts)
    assert m[("nanoserve_kv_cache_usage_perc", ())] == 0.0


@pytest.mark.parametrize("field", ["rejected", "preemptions"])
def test_counters_exist_from_the_start(tiny_llama, field):
    """A dashboard's rate() needs the series before the first event: every counter starts at 0."""
    with running_server(tiny_llama, CONFIG, model_name=NAME) as (url, _):
        name = "nanoserve_requests_rejected_total" if field == "rejected" else "nanoserve_preemptions_total"
        assert scrape(url)[(name, ())] == 0
