"""A swapped sequence whose next token cannot fit even in an empty pool is failed, not waited for.

Found by the engine state machine's n > 1 rule (benchmarks/fuzz_engine.py, seed 1044): a
prompt that fills the whole pool (48 tokens, 12 blocks of 4), n = 2, swap preemption. After
the first token both sequences share the 12 blocks and each needs a 13th: the newest is
swapped out, the other is failed (it cannot fit even alone). The swapped one could never come
back either (12 blocks + 1), and while a sequence is swapped out nobody is admitted: the
engine stopped admitting for good, and `nanoserve serve --preemption-mode swap` with it.
"""

from __future__ import annotations

from engine_checks import FoldWatcher
from machine_reference import small_engine

from nanoserve import SamplingParams
from nanoserve.trace_check import check_trace


def test_the_swapped_fork_that_never_fits_is_failed_and_the_engine_goes_on():
    engine = small_engine(4, 12, 16, 4, True, 64, enable_prefix_caching=False, preemption_mode="swap",
                          num_cpu_blocks=40)
    events: list = []
    engine.subscribe(events.append)
    watcher = FoldWatcher(engine)
    engine.add_request("big", [0] * 48, SamplingParams(n=2, temperature=1.0, max_tokens=2))
    engine.add_request("next", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    finished = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        watcher.check(engine)
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    big = finished["big"].outputs
    assert [c.finish_reason for c in big] == ["abort", "abort"]
    assert all("blocks of the pool" in c.error for c in big)
    assert finished["next"].outputs[0].finish_reason == "length"    # admitted and served after it
    assert engine.cpu_pool.num_used_blocks == 0 and engine.pool.num_used_blocks == 0
    check_trace(events, "the run's events")
