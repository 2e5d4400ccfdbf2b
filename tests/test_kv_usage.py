"""One definition of "used", "cached" and "hit rate" (nanoserve/kv_usage.py), shared by every screen.

The server's /metrics counts from the live engine, the TUI from the events it
folded, possibly joining mid-run (attach). Step by step through a workload with
a shared prefix (hits) and a pool small enough to evict, both must give the
same numbers, and the TUI's metric labels must print them.
"""

from __future__ import annotations

import pytest

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.fold import fold, synced_event
from nanoserve.kv_usage import KVUsage, hit_rate, kv_usage
from nanoserve.serve.metrics import ServerMetrics

PREFIX = "You are a helpful assistant who answers in one short sentence. "
QUESTIONS = ["What is a KV cache?", "Why page it?", "What is a block?", "Who frees it?", "What is a hit?"]


def gauges(metrics: ServerMetrics) -> tuple[KVUsage, float]:
    """/metrics' kv blocks and hit rate, read back from its registry."""
    value, name = metrics.registry.get_sample_value, {"model_name": metrics.model_name}   # (every series has it)
    usage = KVUsage(*(int(value("nanoserve_kv_blocks", {**name, "state": s})) for s in ("used", "cached", "free")))
    return usage, value("nanoserve_prefix_cache_hit_rate", name)


def test_kv_usage_adds_up_and_hit_rate_waits_for_a_lookup():
    assert kv_usage(20, 5, 3) == KVUsage(used=12, cached=3, free=5) and kv_usage(20, 5, 3).total == 20
    assert hit_rate(0, 0) is None and hit_rate(3, 4) == 0.75
    with pytest.raises(ValueError):
        kv_usage(4, 5, 0)


@pytest.mark.parametrize("join_at", [0, 6])
def test_the_tui_and_metrics_count_the_same_blocks_and_hit_rate(tiny_llama, join_at):
    from nanoserve_tui.source import Frame
    from nanoserve_tui.widgets.metrics import series

    engine = LLMEngine(EngineConfig(model=tiny_llama.name, block_size=4, num_blocks=40, max_num_seqs=2,
                                    max_num_batched_tokens=32), loaded=tiny_llama)
    metrics = ServerMetrics()
    state, checked, hits = None, 0, False
    pending = list(enumerate(QUESTIONS))
    events: list = []
    engine.subscribe(events.append)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, q = pending.pop(0)
            engine.add_request(f"q{i}", PREFIX + q, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        if step == join_at:                      # a viewer attaches here: it starts from the snapshot
            state, events[:] = fold(None, synced_event(engine.snapshot())), []
        result = engine.step()
        step += 1
        metrics.after_step(engine, result)
        if state is None:
            continue
        for e in events:
            state = fold(state, e)
        events.clear()
        usage, rate = gauges(metrics)
        assert state.kv_usage() == usage, f"step {step}"
        assert (state.cache_hit_rate() or 0.0) == pytest.approx(rate), f"step {step}"
        (kv_label, *_), _, _ = series(Frame(state, ()))["kv"]
        assert f"KV {usage.used} used · {usage.cached} cached /40" == kv_label
        (hit_label, *_), _, _ = series(Frame(state, ()))["hit"]
        if rate:
            assert hit_label == f"cache hit {100 * rate:.0f}%"
        hits |= rate > 0 and usage.cached > 0
        checked += 1
    assert checked >= 10 and hits, "the workload hits the cache and leaves cached-only blocks"
