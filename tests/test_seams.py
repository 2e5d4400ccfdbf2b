"""The engine's seams: one step number, block moves in the plan, modes that decide and a request table that applies.

Beam search and speculative decoding only *decide* (`beam_search.decide` returns a `BeamStep`,
`spec_decode.decide` a `Verdict`, `spec_decode.propose` the `Drafts`); the engine applies what
they return. These tests wrap each decision function and check that calling it changes none of
the engine's state, and that the run still ends with the same tokens.
"""

from __future__ import annotations

import pytest
from conftest import make_engine, run_to_end

from nanoserve import EngineConfig, SamplingParams, beam_search, spec_decode
from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.intake import PreparedRequest
from nanoserve.kv_manager import KVManager
from nanoserve.request import Request
from nanoserve.request_table import RequestTable
from nanoserve.sampler import SampledToken
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence
from nanoserve.trace import event_from_dict


def test_one_step_number_shared_by_every_part(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32, num_cpu_blocks=8)
    assert engine.scheduler.clock is engine.clock and engine.kv.clock is engine.clock
    assert engine.radix.clock is engine.clock
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    for n in (1, 2):
        result = engine.step()
        assert engine.step_count == engine.scheduler.step == engine.kv.step == engine.radix.step == n
        stamps = {e.step for e in result.events if not isinstance(e, ev.RequestAdded)}   # (added before step 1)
        assert stamps == {n}, "every event of step n is stamped n"
    with pytest.raises(AttributeError):
        engine.step_count = 7          # only step() advances it


def test_block_moves_come_in_the_plan(tiny_llama):
    """The copy-on-write copy a fork needs is in the plan the scheduler returns, nowhere else."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    engine.add_request("p", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()                                  # 5 prompt tokens + 1 sampled: block 1 partly full
    engine.fork("p")
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda drafts=None: plans.append(schedule(drafts)) or plans[-1]
    result = engine.step()
    copies = [(e.src, e.dst) for e in result.events if isinstance(e, ev.CowCopied)]
    assert copies and plans[0].moves.copies == copies


def _unchanged_by(monkeypatch, module, name, engine, calls):
    """Wrap module.name: the engine's snapshot must be the same before and after each call."""
    original = getattr(module, name)

    def checked(*args, **kwargs):
        before = engine.snapshot()
        out = original(*args, **kwargs)
        assert engine.snapshot() == before, f"{module.__name__}.{name} changed the engine's state"
        calls.append(out)
        return out

    monkeypatch.setattr(module, name, checked)


def test_beam_search_decides_and_the_engine_applies(tiny_llama, monkeypatch):
    params = SamplingParams(max_tokens=6, beam_width=3, n=3, temperature=0, ignore_eos=True)
    reference = make_engine(tiny_llama, block_size=4, num_blocks=64)
    reference.add_request("b", [5, 6, 7, 8, 9], params)
    want = run_to_end(reference)["b"]
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    calls = []
    _unchanged_by(monkeypatch, beam_search, "decide", engine, calls)
    engine.add_request("b", [5, 6, 7, 8, 9], params)
    got = run_to_end(engine)["b"]
    assert calls and all(isinstance(c, beam_search.BeamStep) for c in calls)
    assert any(fork for c in calls for _, _, fork in c.continuations), "a beam step forked"
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_decides_and_the_engine_applies(tiny_llama, monkeypatch, method):
    config = dict(block_size=4, num_blocks=64, speculative_method=method, num_speculative_tokens=3,
                  **({"draft_num_layers": 1} if method == "draft" else {}))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = make_engine(tiny_llama, block_size=4, num_blocks=64)
    plain.add_request("s", prompt, params)
    want = run_to_end(plain)["s"].outputs[0].token_ids
    engine = make_engine(tiny_llama, **config)
    verdicts, drafts = [], []
    _unchanged_by(monkeypatch, spec_decode, "decide", engine, verdicts)
    original_propose = spec_decode.propose
    monkeypatch.setattr(spec_decode, "propose", lambda *a, **k: drafts.append(original_propose(*a, **k)) or drafts[-1])
    engine.add_request("s", prompt, params)
    assert run_to_end(engine)["s"].outputs[0].token_ids == want
    assert verdicts and all(isinstance(v, spec_decode.Verdict) for v in verdicts)
    assert any(d.tokens for d in drafts)


def test_traces_from_before_the_rename_still_read():
    """Old type names and a sequence-level event's `request_id` read as the new ones."""
    old = {"type": "RequestFinished", "step": 3, "request_id": "r1.1", "finish_reason": "stop",
           "num_output_tokens": 4}
    assert event_from_dict(old) == ev.SequenceFinished(3, "r1.1", "stop", 4)
    assert event_from_dict({"type": "RequestAdmitted", "step": 1, "request_id": "r1"}) == ev.SequenceAdmitted(1, "r1")
    assert event_from_dict({"type": "TokenSampled", "step": 2, "request_id": "r1", "token_id": 7, "text": "a",
                            "logprob": -1.0}).seq_id == "r1"
    added = event_from_dict({"type": "RequestAdded", "step": 0, "request_id": "r1", "prompt": "p",
                             "num_prompt_tokens": 1, "max_tokens": 2})
    assert added.request_id == added.seq_id == "r1"     # a request's first sequence has its id
    synced = event_from_dict({"type": "EngineSynced", "step": 0, "model": "m", "num_blocks": 1, "block_size": 4,
                              "ref_counts": [0], "free_queue": [0], "requests": []})
    assert synced.sequences == ()


def test_the_request_table_applies_tokens_without_an_engine():
    """nano-vllm's `Scheduler.postprocess` in our terms: the request table, built from a scheduler, a KV manager,
    `emit` and the clock (no engine, no model), runs two requests by hand: schedule, pretend to compute,
    append a token. A stop token id ends one ("stop"), max_tokens the other ("length"), a fork shares its
    parent's blocks, and every block goes back to the pool."""
    config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=16, max_model_len=64,
                          max_num_batched_tokens=32)
    pool, clock, events = BlockPool(16, 4), ev.StepClock(), []
    kv = KVManager(pool, None, None, events.append, clock=clock)
    scheduler = Scheduler(config, kv, events.append, clock=clock)
    table = RequestTable(config, scheduler, kv, None, None, None, events.append, clock)
    for rid, params in (("a", SamplingParams(max_tokens=6, stop_token_ids=[9])), ("b", SamplingParams(max_tokens=3))):
        seq = Sequence(rid, None, [1, 2, 3, 4, 5], params)
        table.add(PreparedRequest(seq, Request(rid, params, 0, [seq]), IncrementalDetokenizer(None, params)))
    script = {"a": [7, 9], "a.1": [6, 6, 6, 6, 6], "b": [8, 8, 8]}   # the tokens each sequence "samples"
    outputs = {}
    while table.sequences:
        clock.step += 1
        table.begin_step()
        plan = scheduler.schedule()
        scheduler.mark_computed(plan)
        for chunk in plan.chunks:
            if chunk.samples:
                token = script[chunk.seq.seq_id].pop(0)
                outputs[chunk.seq.request_id] = table.append(chunk.seq, [SampledToken(token, -0.5, None)])
        if clock.step == 1:
            parent = table.sequences["a"]
            child = table.fork(parent, None)
            assert child.block_table == parent.block_table and table.requests["a"].seqs == [parent, child]
            assert all(pool.blocks[b].ref_count == 2 for b in parent.block_table)
    a, b = outputs["a"].outputs, outputs["b"].outputs
    assert [(c.token_ids, c.finish_reason) for c in a] == [([7, 9], "stop"), ([7, 6, 6, 6, 6, 6], "length")]
    assert (b[0].token_ids, b[0].finish_reason) == ([8, 8, 8], "length")
    assert table.finished_ids == {"a", "b"} and not table.requests and not scheduler.running
    assert pool.num_used_blocks == 0, "finishing frees every block"
    finished = [(e.seq_id, e.finish_reason) for e in events if isinstance(e, ev.SequenceFinished)]
    assert sorted(finished) == [("a", "stop"), ("a.1", "length"), ("b", "length")]
