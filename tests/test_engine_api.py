"""The public engine API: bad input, abort, stop conditions, streaming, seeds, logprobs, events."""

from __future__ import annotations

import pytest
from conftest import make_engine, run_to_end, save_tiny
from machine_reference import VOCAB, small_engine

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev
from nanoserve.sequence import SequenceStatus


@pytest.fixture()
def engine(tiny_llama):
    return make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=32)


def greedy(n=8, **kw):
    return SamplingParams(max_tokens=n, temperature=0, **kw)


# -- bad input: a clear ValueError and an unchanged engine ----------------------------------------


@pytest.mark.parametrize("prompt, params, match", [
    ("", None, "empty"),
    ([], None, "empty"),
    ([1, 2, 10**6], None, "outside the vocabulary"),
    ([1] * 300, None, "max_model_len"),
])
def test_bad_prompts_leave_engine_unchanged(tiny_llama, prompt, params, match):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_model_len=256)
    engine.add_request("ok", [1, 2, 3], greedy())
    before = engine.snapshot()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert engine.snapshot() == before
    engine.check_invariants()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n must be"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id(engine):
    engine.add_request("a", [1, 2, 3], greedy())
    before = engine.snapshot()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [4, 5], greedy())
    assert engine.snapshot() == before


def test_unknown_model_lists_what_is_accepted():
    with pytest.raises(ValueError, match="tiny-llama.*smollm2"):
        LLMEngine(EngineConfig(model="/no/such/model/dir"))


def test_text_prompt_without_tokenizer(tmp_path):
    path = save_tiny("tiny-llama", tmp_path / "m", with_tokenizer=False)
    engine = LLMEngine(EngineConfig(model=path, num_blocks=32))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("t", "hello", greedy())
    engine.add_request("ids", [1, 2, 3], greedy(4))     # token ids still work
    assert len(run_to_end(engine)["ids"].outputs[0].token_ids) == 4


def test_bad_config():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="cuda-magic")


# -- abort ------------------------------------------------------------------------------------------


def test_abort_unknown_raises_keyerror(engine):
    with pytest.raises(KeyError):
        engine.abort_request("nope")


def test_abort_running_frees_all_blocks_at_once(engine):
    engine.add_request("a", list(range(1, 30)), greedy(50))
    engine.add_request("b", [5, 6, 7], greedy(50))
    for _ in range(3):
        engine.step()
    held = len(engine.scheduler.running[0].block_table)
    available_before = engine.kv.num_available_blocks     # free, or cached and nobody's
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.num_available_blocks == available_before + held
    engine.check_invariants()
    assert [e for e in engine.step().events if isinstance(e, ev.SequenceAborted)][0].seq_id == "a"
    run_to_end(engine)
    engine.clear_prefix_cache()
    assert engine.pool.num_used_blocks == 0


# -- stop conditions ---------------------------------------------------------------------------------


def test_max_tokens_and_length_reason(engine):
    engine.add_request("a", [1, 2, 3], greedy(5))
    out = run_to_end(engine)["a"].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids_and_min_tokens(engine, tiny_llama):
    engine.add_request("probe", [1, 2, 3], greedy(12))
    tokens = run_to_end(engine)["probe"].outputs[0].token_ids
    stop_id = tokens[2]                      # greedy: the third token is known in advance
    first = tokens.index(stop_id)
    engine.add_request("a", [1, 2, 3], greedy(12, stop_token_ids=[stop_id]))
    out = run_to_end(engine)["a"].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: first + 1]
    # With min_tokens the stop id is masked out of sampling until min_tokens tokens exist.
    engine.add_request("b", [1, 2, 3], greedy(12, stop_token_ids=[stop_id], min_tokens=6))
    out = run_to_end(engine)["b"].outputs[0]
    assert len(out.token_ids) >= 6 and stop_id not in out.token_ids[:6]


def test_stop_string_is_never_in_text_even_while_streaming(engine):
    engine.add_request("probe", "abc", greedy(24))
    text = run_to_end(engine)["probe"].outputs[0].text
    stop = text[5:8]
    assert len(stop) == 3
    engine.add_request("a", "abc", greedy(24, stop=[stop]))
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            streamed += out.outputs[0].delta
            assert stop not in out.outputs[0].text
            final = out
    assert final.outputs[0].finish_reason == "stop"
    assert streamed == final.outputs[0].text == text[: text.index(stop)]


def test_eos_stops_unless_ignored(engine):
    engine.add_request("probe", [1, 2, 3], greedy(12, ignore_eos=True))
    tokens = run_to_end(engine)["probe"].outputs[0].token_ids
    engine.table.eos_token_id = tokens[3]    # pretend the model's EOS is the 4th greedy token
    engine.add_request("a", [1, 2, 3], greedy(12))
    engine.add_request("b", [1, 2, 3], greedy(12, ignore_eos=True))
    out = run_to_end(engine)
    assert out["a"].outputs[0].finish_reason == "stop"
    assert out["a"].outputs[0].token_ids == tokens[: tokens.index(tokens[3]) + 1]
    assert out["b"].outputs[0].token_ids == tokens


# -- streaming, seeds, logprobs -------------------------------------------------------------------------


def test_deltas_add_up_to_text(engine):
    engine.add_request("a", "hello", SamplingParams(max_tokens=20, seed=1))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            deltas.append(out.outputs[0].delta)
            final = out
    assert "".join(deltas) == final.outputs[0].text


def test_seed_reproducible_regardless_of_batch(tiny_llama):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42)
    alone = make_engine(tiny_llama, num_blocks=64)
    alone.add_request("x", [7, 8, 9], params)
    a = run_to_end(alone)["x"].outputs[0].token_ids
    crowded = make_engine(tiny_llama, num_blocks=64, max_num_batched_tokens=8)
    for i in range(5):
        crowded.add_request(f"other{i}", [i + 1] * (i + 3), SamplingParams(max_tokens=10, temperature=1.0))
    crowded.add_request("x", [7, 8, 9], params)
    assert run_to_end(crowded)["x"].outputs[0].token_ids == a


def test_logprobs(engine):
    engine.add_request("a", [1, 2, 3], greedy(4, logprobs=3))
    out = run_to_end(engine)["a"].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) >= 3
        assert lp[token] == max(lp.values())          # greedy picks the most likely raw token
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


# -- events and snapshots ----------------------------------------------------------------------------------


def test_events_tell_the_whole_story(engine):
    from nanoserve.trace import fold_all

    seen = []
    engine.subscribe(seen.append)
    engine.add_request("a", list(range(1, 20)), greedy(6, ignore_eos=True))
    engine.add_request("b", [3, 4], greedy(3, ignore_eos=True))
    run_to_end(engine)
    kinds = {type(e).__name__ for e in seen}
    for name in ("EngineSynced", "RequestAdded", "SequenceAdmitted", "ChunkScheduled", "BlocksAllocated",
                 "BlocksFreed", "TokenSampled", "SequenceFinished", "StepStarted", "StepFinished"):
        assert name in kinds
    view = fold_all(seen)
    pool = engine.pool.snapshot()
    assert view.free_queue == pool["free_queue"] and view.ref_counts == pool["ref_counts"]
    assert view.sequences["a"].num_output_tokens == 6
    assert view.sequences["b"].status == "finished_length"


def test_fold_matches_snapshot_after_every_step_under_preemption(tiny_llama):
    from nanoserve.trace import fold

    engine = make_engine(tiny_llama, block_size=4, num_blocks=14, max_num_batched_tokens=16)
    state = None
    def on_event(e):
        nonlocal state
        state = fold(state, e)
    engine.subscribe(on_event)
    for i in range(6):
        engine.add_request(f"r{i}", list(range(1, 10 + 3 * i)), greedy(12))
    preempted = 0
    while engine.has_unfinished_requests():
        preempted += engine.step().stats.num_preempted
        snap = engine.snapshot()
        assert state.free_queue == snap["pool"]["free_queue"]
        assert state.ref_counts == snap["pool"]["ref_counts"]
        assert state.running == snap["running"] and state.waiting == snap["waiting"]
        for r in snap["sequences"]:
            assert state.sequences[r["seq_id"]].block_table == r["block_table"]
    assert preempted > 0


def test_request_that_can_never_fit_fails_with_a_reason(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=4, max_model_len=64)
    engine.add_request("big", list(range(1, 30)), greedy(4))
    engine.add_request("small", [1, 2], greedy(4))
    finished = run_to_end(engine, max_steps=100)
    big = finished["big"].outputs[0]
    assert big.finish_reason == "abort" and "pool" in big.error
    assert finished["small"].outputs[0].finish_reason == "length"


def test_repl_rendering(engine):
    engine.add_request("a", "hello", greedy(3))
    text = repr(engine)
    assert "LLMEngine" in text and "waiting" in text
    result = engine.step()
    assert "step 1" in repr(result)


def test_jupyter_reprs(engine):
    import shutil

    engine.add_request("a", "hello", greedy(3))
    engine.step()
    assert "StepResult" in engine.step()._repr_html_()
    assert "BlockPool" in engine.pool._repr_html_()
    html = engine._repr_html_()
    assert "LLMEngine" in html
    if shutil.which("dot"):
        assert "<svg" in html and "<svg" in engine._repr_svg_()


def test_subscribing_mid_run_folds_to_the_snapshot(tiny_llama):
    """A viewer that joins late (EngineSynced mid-run) sees the same pool, tables and queue order."""
    from nanoserve.trace import fold

    engine = make_engine(tiny_llama, block_size=4, num_blocks=14, max_num_batched_tokens=16)
    for i in range(6):
        engine.add_request(f"r{i}", list(range(1, 10 + 3 * i)), greedy(12))
    for _ in range(12):
        engine.step()
    state = None
    def on_event(e):
        nonlocal state
        state = fold(state, e)
    engine.subscribe(on_event)
    while engine.has_unfinished_requests():
        snap = engine.snapshot()
        assert state.running == snap["running"] and state.waiting == snap["waiting"]
        assert state.free_queue == snap["pool"]["free_queue"]
        for r in snap["sequences"]:
            view = state.sequences[r["seq_id"]]
            assert (view.block_table, view.max_tokens) == (r["block_table"], r["max_tokens"])
        engine.step()


# -- small pools: abort, preemption, a request that outgrows the pool (the state machine's model) ------


def test_abort_running_request_frees_all_blocks_at_once():
    engine = small_engine(4, 24, 16, 4, enable_prefix_caching=False)
    engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=20, temperature=0))
    engine.add_request("b", list(range(40, 50)), SamplingParams(max_tokens=20, temperature=0))
    for _ in range(4):
        engine.step()
    seq = engine.sequences["a"]
    assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) >= 8
    table = list(seq.block_table)
    free_before = engine.pool.num_free_blocks
    out = engine.abort_request("a")
    assert engine.pool.num_free_blocks == free_before + len(table)
    assert out.outputs[0].finish_reason == "abort"
    engine.check_invariants()
    # The freed blocks sit at the tail of the free queue, the request's last block first.
    assert engine.pool.free_queue.ids()[-len(table):] == table[::-1]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert engine.pool.num_used_blocks == 0


def test_small_pool_preempts_and_still_drains():
    """The machine's pool really does preempt: four long requests in 24 blocks of 4."""
    engine = small_engine(4, 24, 16, 4, enable_prefix_caching=False)
    for i in range(4):
        engine.add_request(f"r{i}", [(7 * i + j) % VOCAB for j in range(24)],
                           SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    preempted = 0
    while engine.has_unfinished_requests():
        preempted += engine.step().stats.num_preempted
        engine.check_invariants()
    assert preempted > 0
    assert engine.pool.num_used_blocks == 0


def test_request_that_outgrows_the_pool_is_failed_and_frees_its_blocks():
    """max_model_len above the pool's capacity: the request fails with an error, nothing leaks."""
    engine = small_engine(4, 8, 16, 4, max_model_len=64, enable_prefix_caching=False)  # the pool holds 32 tokens
    engine.add_request("big", list(range(1, 21)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        engine.check_invariants()
    comp = finished["big"]
    assert comp.finish_reason == "abort" and comp.error
    # It ran until all 32 slots held KV (the 33rd token is sampled from them), then gave up.
    assert 20 + len(comp.token_ids) == 33
    assert engine.pool.num_used_blocks == 0
