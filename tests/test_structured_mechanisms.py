"""Structured output with every mechanism: each sequence's matcher follows exactly its own tokens.

A workload of constrained requests (greedy and seeded sampling, n > 1, a user's
fork) runs once on a roomy engine; then again with preemption by recompute and
by swap, chunked prefill, the prefix cache, speculative decoding (greedy: the
same tokens), a failed step, and a what-if rewind and branch. Every run must
give the same tokens, every output must match its grammar, and a failed step
must leave every matcher as it was. Speculative decoding's sampled output is
checked by distribution in test_structured_spec_distribution.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_engine, run_to_end
from test_structured_output import SPECS, allowed_after, matches

from nanoserve import EngineConfig, SamplingParams
from nanoserve import events as ev
from nanoserve.errors import StepFailed
from nanoserve.trace import fold_all
from nanoserve.trace_check import check_trace
from nanoserve.whatif.run import Run

PROMPT = "The engine writes "
WORKLOAD = {   # request id -> (kind, SamplingParams fields)
    "json-greedy": ("json", dict(temperature=0)),
    "json-sampled": ("json", dict(temperature=1.0, seed=7)),
    "regex": ("regex", dict(temperature=0.8, seed=3)),
    "choice-n3": ("choice", dict(temperature=1.0, seed=5, n=3)),
    "grammar": ("grammar", dict(temperature=1.0, seed=11, top_p=0.9)),
}
ROOMY = dict(block_size=4, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=512)
SMALL = dict(block_size=4, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)   # preempts


def add_workload(engine, greedy_only: bool = False) -> None:
    for i, (rid, (kind, fields)) in enumerate(WORKLOAD.items()):
        if greedy_only and fields.get("temperature") != 0:
            continue
        engine.add_request(rid, f"{rid}: " + PROMPT * (1 + i % 3), SamplingParams(max_tokens=60, structured_outputs=SPECS[kind],
                                                                     **fields))


def outputs(finished: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason) for c in out.outputs] for rid, out in finished.items()}


def check_grammars(finished: dict) -> None:
    for rid, out in finished.items():
        for c in out.outputs:
            assert c.finish_reason == "stop" and matches(WORKLOAD[rid][0], c.text), (rid, c.text)


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    engine = make_engine(tiny_llama, **ROOMY)
    add_workload(engine)
    finished = run_to_end(engine)
    check_grammars(finished)
    return outputs(finished)


@pytest.mark.parametrize("name, config", [
    ("recompute", dict(SMALL)),
    ("swap", dict(SMALL, preemption_mode="swap", num_cpu_blocks=64)),
    ("chunked-prefill", dict(block_size=4, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=8)),
    ("no-prefix-cache", dict(ROOMY, enable_prefix_caching=False)),
])
def test_mechanisms_change_no_token(tiny_llama, baseline, name, config):
    engine = make_engine(tiny_llama, **config)
    events = []
    engine.subscribe(events.append)
    add_workload(engine)
    finished = run_to_end(engine)
    assert outputs(finished) == baseline
    kinds = {type(e).__name__ for e in events}
    expected = {"recompute": "Preempted", "swap": "SwappedOut", "chunked-prefill": "ChunkScheduled",
                "no-prefix-cache": "TokenConstrained"}[name]
    assert expected in kinds
    if name == "chunked-prefill":
        assert any(e.is_prefill and e.num_tokens == 8 for e in events if isinstance(e, ev.ChunkScheduled))
    if name in ("recompute", "swap"):       # preempted mid-output, with the grammar part way through
        preempted = {e.seq_id for e in events if isinstance(e, ev.Preempted)}
        assert any(e.seq_id in preempted for e in events if isinstance(e, ev.TokenConstrained))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_under_a_grammar_keeps_the_tokens(tiny_llama, baseline, method):
    extra = dict(ngram_min=1, ngram_max=3) if method == "ngram" else dict(draft_num_layers=1)
    engine = make_engine(tiny_llama, **ROOMY, speculative_method=method, num_speculative_tokens=3, **extra)
    add_workload(engine, greedy_only=True)
    events = []
    engine.subscribe(events.append)
    finished = run_to_end(engine)
    assert outputs(finished) == {rid: baseline[rid] for rid in finished}
    verified = [e for e in events if isinstance(e, ev.DraftVerified)]
    assert verified and any(e.num_accepted < e.num_drafted for e in verified)   # rejections happened


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_a_failed_step_leaves_every_matcher_as_it_was(tiny_llama, baseline, speculative):
    """The token choice raises in step 6, after the masks (and the drafts' masks) were read: nothing moved."""
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3) if speculative else {}
    engine = make_engine(tiny_llama, **ROOMY, **spec)
    add_workload(engine, greedy_only=bool(speculative))
    real_sampler = engine.sampler

    class FailingOnce:
        armed = True

        def __getattr__(self, name):
            return getattr(real_sampler, name)

        def fail(self, result):
            if self.armed and engine.step_count == 6:
                self.armed = False
                raise RuntimeError("injected failure")
            return result

        def __call__(self, logits, rows):        # plain sampling: masks applied, RNGs drawn, then it fails
            return self.fail(real_sampler(logits, rows))

        def report(self, logits, tokens, rows):  # speculative: drafts' masks read, verified, then it fails
            return self.fail(real_sampler.report(logits, tokens, rows))

    engine.sampler = FailingOnce()
    finished, failed = {}, 0
    while engine.has_unfinished_requests():
        before = {s.seq_id: (s.num_output_tokens, s.grammar.next_mask().tolist()) for s in engine.sequences.values()}
        try:
            result = engine.step()
        except StepFailed:
            failed += 1
            assert {s.seq_id: (s.num_output_tokens, s.grammar.next_mask().tolist())
                    for s in engine.sequences.values()} == before
            continue
        engine.check_invariants()
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    assert failed == 1 and outputs(finished) == {rid: baseline[rid] for rid in finished}


def test_engine_fork_gives_the_fork_its_own_matcher(tiny_llama):
    engine = make_engine(tiny_llama, **ROOMY)
    engine.add_request("j", PROMPT, SamplingParams(max_tokens=80, temperature=1.0, seed=2,
                                                   structured_outputs=SPECS["json"]))
    while engine.sequences["j"].num_output_tokens < 4:
        engine.step()
    child = engine.fork("j", seed=9)
    assert engine.sequences[child].grammar.matcher is not engine.sequences["j"].grammar.matcher
    out = run_to_end(engine)["j"].outputs
    assert len(out) == 2 and all(c.finish_reason == "stop" and matches("json", c.text) for c in out)
    assert out[0].token_ids[:4] == out[1].token_ids[:4] and out[0].token_ids != out[1].token_ids


def test_a_rewind_and_a_branch_replay_the_same_grammar(tiny_llama):
    run = Run.start(EngineConfig(model=tiny_llama.name, **ROOMY), loaded=tiny_llama)
    add_workload(run.engine)
    run.run_to()
    first = [e for e in run.events if isinstance(e, ev.TokenSampled)]
    again = run.rewind(4).run_to()
    swapped = run.branch(4, num_blocks=24, max_num_batched_tokens=64, max_model_len=128).run_to()
    for other in (again, swapped):
        after = [(e.seq_id, e.token_id) for e in other.events if isinstance(e, ev.TokenSampled)]
        assert sorted(after) == sorted((e.seq_id, e.token_id) for e in first)
    assert any(isinstance(e, ev.Preempted) for e in swapped.events)


def test_events_fold_and_check(tiny_llama):
    run = Run.start(EngineConfig(model=tiny_llama.name, **ROOMY), loaded=tiny_llama)
    add_workload(run.engine)
    run.run_to()
    check_trace(run.events)
    state = fold_all(run.events)
    constrained = [e for e in run.events if isinstance(e, ev.TokenConstrained)]
    for seq_id, view in state.sequences.items():
        mine = [e for e in constrained if e.seq_id == seq_id]
        assert view.grammar is not None and view.grammar.num_forced == sum(e.forced for e in mine)
        assert view.grammar.kind == WORKLOAD[seq_id.split(".")[0]][0]
        assert view.grammar.summary().startswith(f"grammar {view.grammar.kind}: ")
    # The oracle agrees with every event's count: a fresh matcher over the sequence's earlier tokens.
    engine = run.engine
    tokens: dict[str, list[int]] = {}
    for e in run.events:
        if isinstance(e, ev.TokenConstrained):
            kind = WORKLOAD[e.seq_id.split(".")[0]][0]
            assert e.num_allowed == len(allowed_after(engine, SPECS[kind], tokens.get(e.seq_id, [])))
        if isinstance(e, ev.TokenSampled):
            tokens.setdefault(e.seq_id, []).append(e.token_id)
        if isinstance(e, ev.Forked):
            tokens[e.seq_id] = list(tokens.get(e.parent_id, []))
    # `nanoserve plot --what grammar` draws exactly these numbers
    from nanoserve.whatif.metrics import measure
    from nanoserve.whatif.plots import grammar_data, render
    drawn = grammar_data(measure(run.events))
    assert drawn == {sid: [(e.num_allowed, e.forced, e.top_masked) for e in constrained if e.seq_id == sid]
                     for sid in state.sequences}
    assert render(run.events, "grammar", "svg").startswith(b"<?xml")
    first = run.events.index(constrained[0])     # the same event, its `forced` contradicting its mask
    bad = dataclasses.replace(constrained[0], forced=constrained[0].num_allowed != 1)
    with pytest.raises(ValueError, match="forced"):
        check_trace(run.events[:first] + [bad] + run.events[first + 1:])
