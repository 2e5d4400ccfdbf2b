"""Hardening (issue 12): no valid input crashes or wedges the engine, and a failed step loses nothing.

Each regression test below failed on the engine before the fix it names. Every
engine here is watched by a folding subscriber, and `fold == snapshot` is
checked along with `check_invariants()`. Bad input is tests/test_bad_input.py.
"""

from __future__ import annotations

import pytest
from conftest import make_engine
from engine_checks import FoldWatcher, drive, greedy, tokens

from nanoserve import LLM, SamplingParams
from nanoserve import events as ev
from nanoserve.errors import FieldError, StepFailed, SubscriberError
from nanoserve.sampler import Sampler

# -- 1. beam search under preemption ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("width, max_tokens, prompt_len", [(3, 6, 5), (2, 8, 5), (3, 8, 8), (2, 8, 3)])
def test_beam_search_under_preemption_keeps_the_queues_straight(tiny_llama, mode, width, max_tokens, prompt_len):
    """Regression: admitting a waiting beam preempted idle beams to the queue's front, then popleft()
    removed the wrong one: a beam both waiting and running, `illegal transition WAITING -> ...`."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=6,
                         preemption_mode=mode)
    watcher = FoldWatcher(engine)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 + 3 * i, 10 + 3 * i + prompt_len)), greedy(max_tokens))
    engine.add_request("b", list(range(1, 1 + prompt_len)), greedy(max_tokens, beam_width=width))
    finished = drive(engine, watcher)
    assert set(finished) == {"r0", "r1", "r2", "b"}
    # The ordinary requests are unchanged by the beam's company (greedy, run alone).
    for i in range(3):
        alone = make_engine(tiny_llama, block_size=4, num_blocks=64)
        alone.add_request("x", list(range(10 + 3 * i, 10 + 3 * i + prompt_len)), greedy(max_tokens))
        assert drive(alone)["x"].outputs[0].token_ids == finished[f"r{i}"].outputs[0].token_ids


# -- 2. draft speculation with a tiny token budget ---------------------------------------------------


def test_draft_speculation_with_a_budget_of_two_keeps_going(tiny_llama):
    """Regression: drafts the budget left out rolled the draft cache back to cover the last token,
    and every later step raised `every RunInput needs at least one token`."""
    outs = []
    for spec in (dict(speculative_method="draft", draft_num_layers=1), {}):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=32, max_num_batched_tokens=2, **spec)
        watcher = FoldWatcher(engine)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i], greedy(8))
        outs.append(tokens(drive(engine, watcher)))
    assert outs[0] == outs[1]


# -- 3. exceptions inside step(), and LLM.generate (NaN settings: test_bad_input.py) ----------------------------------------------------


def test_a_subscriber_that_raises_once_stops_nothing(tiny_llama):
    """Regression: an exception from a subscriber escaped mid-step and left requests that never finish."""
    reference = make_engine(tiny_llama, block_size=4, num_blocks=32)
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    watcher = FoldWatcher(engine)
    raised = []

    def flaky(event):
        if isinstance(event, ev.TokenSampled) and not raised:
            raised.append(event)
            raise RuntimeError("viewer broke")

    engine.subscribe(flaky)
    for e in (reference, engine):
        e.add_request("a", [1, 2, 3], greedy(6))
        e.add_request("b", [4, 5], greedy(4))
    with pytest.raises(SubscriberError, match="viewer broke") as info:
        engine.step()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.result.stats.num_seqs == 2          # the step itself was done
    engine.check_invariants()
    watcher.check(engine)                                  # the other viewers saw every event
    assert tokens(drive(engine, watcher)) == tokens(drive(reference))


def test_generate_refuses_a_bad_batch_before_queueing_any(tiny_llama):
    """Regression: one bad prompt in a batch left the earlier ones queued."""
    llm = LLM(tiny_llama.name, block_size=4, num_blocks=32)
    llm.engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    with pytest.raises(FieldError, match=r"prompt .*\(prompt 2 of 3\)") as info:
        llm.generate([[1, 2], [3, 4], [5, 1.5]], greedy(3), use_tqdm=False)
    assert info.value.field == "prompt"
    assert not llm.engine.has_unfinished_requests() and llm.engine.step_count == 0
    assert [len(o.outputs[0].token_ids) for o in llm.generate([[1, 2], [3]], greedy(3), use_tqdm=False)] == [3, 3]


def test_generate_that_fails_leaves_nothing_behind(tiny_llama):
    """Regression: an exception while stepping left unfinished requests that hung the next generate."""
    llm = LLM(tiny_llama.name, block_size=4, num_blocks=32)
    llm.engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    run = llm.engine.runner.run
    calls = []

    def broken_once(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return run(batch)

    llm.engine.runner.run = broken_once
    with pytest.raises(StepFailed, match="device lost"):
        llm.generate([[1, 2, 3], [4, 5]], greedy(5), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    outs = llm.generate([[1, 2, 3], [4, 5]], greedy(5), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


# -- a step is all or nothing ---------------------------------------------------------------------------


WORKLOAD = [("g", list(range(1, 14)), greedy(10)),
            ("s", list(range(20, 27)), SamplingParams(max_tokens=9, temperature=1.0, seed=7, ignore_eos=True)),
            ("n", list(range(30, 35)), SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)),
            ("u", list(range(1, 9)), SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True))]
SMALL = dict(block_size=4, num_blocks=14, max_num_batched_tokens=8, max_num_seqs=4)


def run_workload(tiny_llama, fail_at=None, where="run", exc=RuntimeError, **config):
    """The workload on a small pool. With `fail_at`, the `where` part of the runner (or the sampler)
    raises once: in step `fail_at`, or with fail_at="first" the first time it has work to do."""
    engine = make_engine(tiny_llama, **{**SMALL, **config})
    watcher = FoldWatcher(engine)
    for rid, prompt, params in WORKLOAD:
        engine.add_request(rid, prompt, params)
    original = engine.sampler.__call__ if where == "sampler" else getattr(engine.runner, where)
    failures = []

    def maybe_fail(*args, **kwargs):
        due = engine.step_count == fail_at or (fail_at == "first" and args[0])
        if due and not failures:
            failures.append(engine.step_count)
            raise exc(f"injected failure in {where}")
        return original(*args, **kwargs)

    if where == "sampler":
        class FlakySampler(Sampler):
            def __call__(self, *args, **kwargs):
                return maybe_fail(*args, **kwargs)
        engine.sampler = FlakySampler()
    else:
        setattr(engine.runner, where, maybe_fail)
    finished, caught = {}, []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        try:
            result = engine.step()
        except (StepFailed, KeyboardInterrupt) as e:
            caught.append(e)
            result = e.result if isinstance(e, StepFailed) else e.step_result
        finished.update({o.request_id: o for o in result.outputs if o.finished})
        engine.check_invariants()
        watcher.check(engine)
    assert not engine.has_unfinished_requests()
    return finished, caught, failures


@pytest.mark.parametrize("where, fail_at, config", [
    ("run", 1, {}), ("run", 4, {}), ("run", 9, {}),
    ("sampler", 3, {}),
    ("copy_blocks", "first", {}),                            # n=2 forks: copy-on-write copies
    ("swap_out", "first", dict(preemption_mode="swap", num_blocks=10)),
    ("swap_in", "first", dict(preemption_mode="swap", num_blocks=10)),
    ("run", 6, dict(speculative_method="draft", draft_num_layers=1)),
    ("run", 6, dict(speculative_method="ngram")),
])
def test_a_failed_step_is_undone_and_loses_nothing(tiny_llama, where, fail_at, config):
    """An exception in the compute phase: StepFailed names the requests, invariants and the fold hold,
    and the seeded/greedy outputs equal those of a run without the failure."""
    reference, _, _ = run_workload(tiny_llama, **config)
    finished, caught, failures = run_workload(tiny_llama, fail_at, where, **config)
    assert failures, f"step {fail_at} never reached {where}"
    assert len(caught) == 1 and f"injected failure in {where}" in str(caught[0])
    assert caught[0].request_ids and all(rid.split(".")[0] in "gsnu" for rid in caught[0].request_ids)
    if where in ("copy_blocks", "swap_in", "swap_out"):   # KV that never arrived is recomputed
        assert any(isinstance(e, ev.Preempted) and e.mode == "recompute" for e in caught[0].result.events)
    assert set(finished) == set(reference)
    for rid in ("g", "s", "n"):   # greedy and seeded: the same tokens as without the failure
        assert tokens(finished)[rid] == tokens(reference)[rid], rid


def test_ctrl_c_in_the_forward_is_undone_and_raised_as_is(tiny_llama):
    reference, _, _ = run_workload(tiny_llama)
    finished, caught, _ = run_workload(tiny_llama, 3, "run", exc=KeyboardInterrupt)
    assert len(caught) == 1 and isinstance(caught[0], KeyboardInterrupt)
    assert {rid: tokens(finished)[rid] for rid in "gsn"} == {rid: tokens(reference)[rid] for rid in "gsn"}


def test_nan_logits_fail_only_their_request(tiny_llama):
    """A row of NaN logits (a broken model, an overflow) finishes that request with an error;
    the others go on and produce what they would have."""
    reference, _, _ = run_workload(tiny_llama)
    engine = make_engine(tiny_llama, **SMALL)
    watcher = FoldWatcher(engine)
    for rid, prompt, params in WORKLOAD:
        engine.add_request(rid, prompt, params)
    run = engine.runner.run

    def poisoned(batch):
        logits = run(batch)
        if engine.step_count == 4:           # row 0: the first chunk that samples in step 4
            logits = logits.clone()
            logits[0] = float("nan")
        return logits

    engine.runner.run = poisoned
    finished = drive(engine, watcher)
    failed = [rid for rid, out in finished.items() if out.outputs[0].error]
    assert len(failed) == 1 and "not a distribution" in finished[failed[0]].outputs[0].error
    assert finished[failed[0]].outputs[0].finish_reason == "abort"
    for rid in set("gsn") - set(failed):
        assert tokens(finished)[rid] == tokens(reference)[rid]


# -- 4. aborting one beam ----------------------------------------------------------------------------------


def test_aborting_one_beam_never_overfills_the_batch(tiny_llama):
    """Regression: after abort_request("b.2") its seat went to a waiting request, and the next
    beam step re-forked a third beam anyway: more than max_num_seqs sequences running."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_seqs=4)
    watcher = FoldWatcher(engine)
    engine.add_request("b", [1, 2, 3, 4], greedy(8, beam_width=3))
    engine.add_request("r", [5, 6, 7], greedy(3))
    engine.add_request("w", [8, 9], greedy(6))      # waits for a seat
    while "b.2" not in engine.sequences:
        engine.step()
    engine.abort_request("b.2")
    finished = drive(engine, watcher)
    assert set(finished) == {"b", "r", "w"} and finished["b"].outputs[0].finish_reason == "length"


# -- 5. stop strings with min_tokens ----------------------------------------------------------------------


def test_a_stop_string_complete_before_min_tokens_stops_nothing(tiny_llama):
    """Regression: a stop string complete at token k with min_tokens=k+1 stopped the request at
    token k+1 anyway, with half the stop string already in the text (stop=["hf"], min_tokens=6 gave
    '-%hf'). Now it is ordinary text; a match that ends at token min_tokens or later stops."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    engine.add_request("base", "hello", greedy(16))
    base = drive(engine)["base"].outputs[0]
    decode = tiny_llama.tokenizer.decode
    # k: the first 2 characters the k-th token completes that occur nowhere else in the output.
    k, stop = next((k, decode(base.token_ids[:k])[-2:]) for k in range(3, 16)
                   if "\ufffd" not in decode(base.token_ids[:k])[-2:]
                   and decode(base.token_ids[:k])[-2:] not in decode(base.token_ids[:k - 1])
                   and base.text.count(decode(base.token_ids[:k])[-2:]) == 1)
    results = {}
    for min_tokens in (0, k, k + 1):
        engine.add_request(f"m{min_tokens}", "hello", greedy(16, stop=[stop], min_tokens=min_tokens))
        results[min_tokens] = drive(engine)[f"m{min_tokens}"].outputs[0]
    for min_tokens in (0, k):                         # the match ends at token k: it counts
        out = results[min_tokens]
        assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:k]
        assert out.text == decode(base.token_ids[:k])[:-2] and stop not in out.text
    late = results[k + 1]                              # complete before min_tokens: ordinary text
    assert late.finish_reason == "length" and late.token_ids == base.token_ids and late.text == base.text


# -- 6. a reused request id ---------------------------------------------------------------------------------


def test_a_reused_request_id_leaves_no_ghost_in_the_viewers(tiny_llama):
    """Regression: the fold ignored the second request's finish (the id was already in `finished`)."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    watcher = FoldWatcher(engine)
    for _ in range(3):
        engine.add_request("same", [1, 2, 3], greedy(3))
        drive(engine, watcher)
        assert watcher.state.running == [] and watcher.state.finished.count("same") == 1
        assert watcher.state.sequences["same"].status == "finished_length"


# -- found by benchmarks/fuzz_engine.py ------------------------------------------------------------------


def test_two_forks_failed_in_one_step_close_their_request_once(tiny_llama):
    """Regression: when the scheduler failed a request and its fork in the same step, closing the
    first removed the request and closing the second raised KeyError. Here a 48-token prompt fills
    the 12-block pool; after its first token it is forked, and the next step fails both (the 49th
    token's KV can never fit): r in its decode, r.1 when it is readmitted."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=12, max_model_len=64, enable_prefix_caching=False)
    watcher = FoldWatcher(engine)
    engine.add_request("r", list(range(1, 49)), greedy(20))
    engine.step()
    engine.fork("r")
    result = engine.step()
    failed = [e.seq_id for e in result.events if isinstance(e, ev.SequenceFinished)]
    assert failed == ["r", "r.1"]
    engine.check_invariants()
    watcher.check(engine)
    out = result.outputs[-1]
    assert out.finished and all("pool" in c.error for c in out.outputs)


def test_drafts_never_run_past_the_pool(tiny_llama):
    """Regression: drafts were capped by max_model_len (64) but not by the pool (48 tokens): a
    request and its fork drafting near the end of the pool were failed with "needs more than the
    12 blocks of the pool" while their tokens still fitted."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=12, max_model_len=64, enable_prefix_caching=False,
                         speculative_method="ngram", num_speculative_tokens=3)
    watcher = FoldWatcher(engine)
    engine.add_request("r", [1, 2, 3, 4, 5] * 8, greedy(20))     # repetitive: the n-gram proposer drafts
    for _ in range(3):
        engine.step()
    engine.fork("r")
    finished = drive(engine, watcher)
    for comp in finished["r"].outputs:
        assert comp.finish_reason == "abort" and 40 + len(comp.token_ids) > 48, (len(comp.token_ids), comp.error)


def test_a_stuck_beam_is_preempted_before_a_request_that_makes_progress():
    """Regression: a beam waiting for its preempted sibling held 16 of 40 blocks; the newest request
    needed 9 more for its prompt, preempted itself (policy "newest"), was readmitted, and did it
    again, forever. Stuck beams are now the first victims. (Found by benchmarks/fuzz_engine.py.)"""
    from machine_reference import small_engine

    engine = small_engine(1, 40, 16, 4, enable_prefix_caching=False)
    watcher = FoldWatcher(engine)
    engine.add_request("b", [1 + 3 * j for j in range(8)], SamplingParams(beam_width=2, n=2, temperature=0,
                                                                          max_tokens=12, ignore_eos=True))
    for i in range(2):
        engine.add_request(f"r{i}", list(range(1, 14)) + [1 + 11 * i + j for j in range(4)], greedy(20))
    assert set(drive(engine, watcher, max_steps=300)) == {"b", "r0", "r1"}
