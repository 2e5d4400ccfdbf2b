"""Each scenario preset makes its mechanism happen, in a recorded trace and in the live TUI."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve import events as ev
from nanoserve.scenarios import SCENARIOS, record
from nanoserve.trace import read_trace


def shows_mechanism(name: str, events: list) -> bool:
    """Does this run show what scenario `name` exists to show?"""
    kinds = [type(e).__name__ for e in events]
    if name == "continuous-batching":
        # A request is admitted in a step after another has finished, while others still run.
        first_finish = next(i for i, e in enumerate(events) if isinstance(e, ev.RequestFinished))
        return any(isinstance(e, ev.RequestAdmitted) for e in events[first_finish:])
    if name == "memory-pressure":
        return "Preempted" in kinds
    if name == "long-prompt":
        # The long prompt is split over several steps while another request decodes in the same step.
        steps = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and e.request_id == "long" and e.is_prefill}
        decode_steps = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and not e.is_prefill}
        return len(steps) > 1 and bool(steps & decode_steps)
    if name == "shared-system-prompt":
        hits = [e for e in events if isinstance(e, ev.PrefixMatched) and e.num_hit_tokens]
        return sum(isinstance(e, ev.RequestFinished) for e in events) == 5 and len(hits) >= 3
    if name == "parallel-sampling":
        return all(k in kinds for k in ("Forked", "CowCopied", "BeamPruned"))
    if name == "swap-preemption":
        return "SwappedOut" in kinds and "SwappedIn" in kinds
    if name == "speculative-decoding":
        return any(isinstance(e, ev.DraftVerified) and e.num_accepted > 0 for e in events) and "KVTrimmed" in kinds
    if name == "tensor-parallel":
        # Both ranks reported after every forward, with the same slot ledger, and the all-reduces ran.
        reports = [e for e in events if isinstance(e, ev.RankPoolState)]
        same = all(a.digest == b.digest for a, b in zip(reports[::2], reports[1::2]))
        return {e.rank for e in reports} == {0, 1} and same and "CollectiveOps" in kinds and "CowCopied" in kinds
    raise AssertionError(f"no check for scenario {name}")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_recorded_scenario_shows_its_mechanism(name, tmp_path):
    from nanoserve_tui.screenshots import showcase_step

    path = tmp_path / f"{name}.jsonl"
    record(name, path)
    events = read_trace(path)
    assert shows_mechanism(name, events)
    # The docs' screenshot of this scenario is taken at a step of this run.
    assert 1 <= showcase_step(name, events) <= max(e.step for e in events)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_live_tui_runs_each_scenario(name, tmp_path):
    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.source import LiveSource

    path = tmp_path / "live.jsonl"

    async def run():
        app = NanoserveApp(LiveSource(scenario=name, record=path))
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = asyncio.get_running_loop().time() + 60
            while app.frame is None:
                await pilot.pause(0.05)
            await pilot.press("plus", "plus", "plus", "r")          # run, fast
            while not app.frame.at_end:
                assert asyncio.get_running_loop().time() < deadline, "the scenario did not finish"
                await pilot.pause(0.05)
            assert not app.frame.state.running and not app.frame.state.waiting
            await pilot.press("q")

    asyncio.run(run())
    assert shows_mechanism(name, read_trace(path))
