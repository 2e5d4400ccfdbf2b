"""Rewind and branch (nanoserve/whatif/run.py): replaying the command log repeats a run exactly.

The workload turns on what makes replay hard: the prefix cache (shared prompt
prefixes), swap preemption (a pool too small for everyone), n-gram
speculative decoding, sampled requests without a seed of their own (the
engine draws them), a user's fork and a user's abort between steps.
"""

from __future__ import annotations

import dataclasses

import pytest

from nanoserve import EngineConfig, SamplingParams
from nanoserve import events as ev
from nanoserve.errors import FieldError
from nanoserve.whatif import CommandKind, CommandLog, Run

SHARED = list(range(40, 56))     # 16 tokens: whole cached blocks shared by three prompts


def plain(events):
    """Events without their wall-clock field (StepFinished.duration_s), for exact comparison."""
    return [dataclasses.replace(e, duration_s=0.0) if isinstance(e, ev.StepFinished) else e for e in events]


def busy_run(loaded, **changes) -> Run:
    """A run that preempts (swap), hits the prefix cache, speculates, samples, forks and aborts."""
    config = dict(model=loaded.name, block_size=4, num_blocks=14, max_num_batched_tokens=24, max_num_seqs=4,
                  preemption_mode="swap", enable_prefix_caching=True, speculative_method="ngram",
                  num_speculative_tokens=3, ngram_max=2)
    run = Run.start(EngineConfig(**{**config, **changes}), loaded=loaded)
    run.add_request("g", SHARED + [7, 8, 7, 8], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    run.add_request("s", SHARED + [9, 10], SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    run.step()
    run.add_request("t", SHARED + [3], SamplingParams(max_tokens=8, temperature=0.8, top_k=20, ignore_eos=True))
    run.step()
    run.step()
    run.fork("s")                               # a user's fork: its seed is drawn from the engine's RNG
    run.add_request("late", [5, 6, 5, 6, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    run.step()
    run.abort_request("late")
    return run.run_to()


@pytest.fixture(scope="module")
def original(tiny_llama):
    return busy_run(tiny_llama)


def test_the_workload_exercises_every_mechanism(original):
    kinds = {type(e) for e in original.events}
    assert {ev.SwappedOut, ev.SwappedIn, ev.PrefixMatched, ev.DraftVerified, ev.Forked, ev.SequenceAborted} <= kinds
    assert [c.kind for c in original.log.commands].count(CommandKind.ADD) == 4
    assert all(dict(c.params)["seed"] is not None for c in original.log.commands if c.kind is CommandKind.ADD)


def test_rewind_to_any_step_and_step_on_repeats_the_events(original):
    """The strong form: the rewound run's whole event stream (replayed past + new future) is the original's."""
    for k in range(original.step_count + 1):
        again = original.rewind(k)
        assert again.step_count == k
        again.engine.check_invariants()
        while not again.done:
            again.step()
            again.engine.check_invariants()
        assert plain(again.events) == plain(original.events), f"rewind to step {k} diverged"
        assert not again.skipped


def test_rewind_then_rewind_again(original):
    """A rewound run is a run like any other: its own rewind repeats the same events."""
    middle = original.rewind(5)
    assert plain(middle.rewind(2).run_to().events) == plain(original.events)


def test_branch_with_unchanged_settings_is_identical(original):
    branch = original.branch(4, preemption_mode="swap").run_to()
    assert plain(branch.events) == plain(original.events)


def _outputs(events):
    tokens = {}
    for e in events:
        if isinstance(e, ev.TokenSampled):
            tokens.setdefault(e.seq_id, []).append(e.token_id)
    return tokens


def test_branch_with_recompute_keeps_greedy_tokens_and_changes_preemption(tiny_llama, original):
    first = next(e.step for e in original.events if isinstance(e, ev.Preempted))
    branch = original.branch(first, preemption_mode="recompute").run_to()
    kinds = [type(e) for e in branch.events]
    assert ev.SwappedOut not in kinds and ev.Preempted in kinds
    assert [type(e) for e in original.events].count(ev.SwappedOut) > 0
    # greedy requests: same tokens whatever the preemption mode
    assert _outputs(branch.events)["g"] == _outputs(original.events)["g"]
    # before the first preemption the two runs are the same run
    # (after their EngineSynced, which tells their settings apart)
    before = [e for e in original.events[1:] if e.step < first]
    assert plain(branch.events[1:len(before) + 1]) == plain(before)
    assert branch.events[0].num_cpu_blocks == 0 < original.events[0].num_cpu_blocks


def test_a_command_the_branch_cannot_repeat_is_skipped_with_its_reason(tiny_llama):
    run = Run.start(model=tiny_llama.name, block_size=4, num_blocks=32, loaded=tiny_llama)
    run.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    run.run_to(2)
    run.fork("a")
    run.run_to()
    # with a budget of one token per step, "a" is still computing its prompt at step 2
    branch = run.branch(0, max_num_batched_tokens=1, enable_chunked_prefill=True).run_to()
    assert [(c.kind, c.request_id) for c, _ in branch.skipped] == [(CommandKind.FORK, "a")]
    assert "computing its prompt" in branch.skipped[0][1]


def test_branch_refuses_bad_and_fixed_settings(original):
    with pytest.raises(FieldError) as e:
        original.branch(1, block_sise=8)
    assert e.value.field == "block_sise"
    with pytest.raises(FieldError) as e:
        original.branch(1, block_size=0)
    assert e.value.field == "block_size"
    with pytest.raises(FieldError) as e:
        original.branch(1, seed=3)
    assert e.value.field == "seed"
    with pytest.raises(FieldError) as e:
        original.branch(original.step_count + 1)
    assert e.value.field == "step"


def test_the_replay_reuses_the_loaded_weights(original):
    assert original.rewind(1).engine.loaded is original.engine.loaded


def test_a_log_started_late_is_incomplete(tiny_llama):
    from nanoserve.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_llama.name, num_blocks=16), loaded=tiny_llama)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    log = CommandLog()
    engine.subscribe(log)
    assert not log.complete and "after the engine had work" in log.why_incomplete
    with pytest.raises(ValueError, match="from its start"):
        Run(engine, engine.config)


def test_a_recorded_trace_is_a_command_log(original, tmp_path):
    from nanoserve.trace import read_trace, write_trace

    write_trace(tmp_path / "run.jsonl", original.events)
    log = CommandLog.from_events(read_trace(tmp_path / "run.jsonl"))
    assert log.complete and log.commands == original.log.commands
    assert log.config["preemption_mode"] == "swap" and log.config["num_blocks"] == 14
