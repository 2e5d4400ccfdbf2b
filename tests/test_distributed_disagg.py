"""Prefill/decode disaggregation: outputs equal a single engine's, and every KV handoff is checked.

A `DisaggregatedEngine` runs the prefill engine (with the prefix cache) in a
worker process and the decode engine here; each request's KV is shipped
over gloo into the decode pool through a block mapping. Each module-scoped
engine serves several workloads (its worker process starts once).
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import make_engine, run_to_end

from nanoserve import EngineConfig, SamplingParams
from nanoserve import events as ev
from nanoserve.distributed import WorkerDied
from nanoserve.distributed.disaggregated import DisaggregatedEngine
from nanoserve.errors import FieldError
from nanoserve.runner import kv_bytes_per_block
from nanoserve.trace import fold_all

SYSTEM = "You are a helpful assistant. Answer briefly. "
PROMPTS = [SYSTEM + "What is a KV cache?", SYSTEM + "Name a colour.", "The quick brown fox jumps over " * 3,
           "H", SYSTEM + "What is a KV cache? And paging?"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)
CONFIG = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


def single_engine(loaded, prompts, params, **config) -> dict:
    engine = make_engine(loaded, **config)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    return {rid: [c.token_ids for c in out.outputs] for rid, out in run_to_end(engine).items()}


def disaggregated(engine: DisaggregatedEngine, prompts, params, events: list | None = None) -> dict:
    first = len(engine.transfers)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check_invariants()       # both engines, and every handoff byte for byte
    assert len(engine.transfers) == first + len(prompts)
    return done


@pytest.fixture(scope="module")
def llama_pair(tiny_llama):
    with DisaggregatedEngine(EngineConfig(model=tiny_llama.name, num_blocks=96, **CONFIG), loaded=tiny_llama) as d:
        yield d


@pytest.fixture(scope="module")
def gpt2_tight_pair(tiny_gpt2):
    """A decode pool too small for everyone at once: handoffs wait for room, decodes get preempted."""
    with DisaggregatedEngine(EngineConfig(model=tiny_gpt2.name, num_blocks=30, **CONFIG), loaded=tiny_gpt2) as d:
        yield d


def test_greedy_outputs_equal_a_single_engine(tiny_llama, llama_pair):
    seen: list = []
    unsubscribe = llama_pair.subscribe(seen.append)
    got = disaggregated(llama_pair, PROMPTS, GREEDY)
    unsubscribe()
    assert got == single_engine(tiny_llama, PROMPTS, GREEDY, num_blocks=96, **CONFIG)
    # The KV bytes that arrived are exactly the prefill side's blocks of each prompt but its last token.
    per_block = kv_bytes_per_block(tiny_llama.model, CONFIG["block_size"], tiny_llama.model.model.embed_tokens.weight.dtype)
    for t, prompt in zip(llama_pair.transfers[-len(PROMPTS):], PROMPTS):
        assert t.num_tokens == len(prompt.encode()) - 1                  # byte tokenizer: one token per byte
        assert len(t.src_block_ids) == len(t.block_ids) == -(-t.num_tokens // CONFIG["block_size"])
        assert t.num_bytes == len(t.src_block_ids) * per_block
        assert t.sent_digest == t.landed_digest
    transfers = [e for e in seen if isinstance(e, ev.KVTransferred)]
    assert [(e.seq_id, e.num_bytes, e.block_ids) for e in transfers] == \
        [(t.request_id, t.num_bytes, tuple(t.block_ids)) for t in llama_pair.transfers[-len(PROMPTS):]]
    # The prefix cache lives on the prefill side: the shared system prompt was computed once there.
    assert llama_pair.decode.radix is None
    assert llama_pair.prefix_cache["num_hit_tokens"] > 0


def test_the_view_folds_the_handoffs(llama_pair):
    seen: list = []
    unsubscribe = llama_pair.subscribe(seen.append)       # starts with EngineSynced
    disaggregated(llama_pair, PROMPTS[:2], GREEDY)
    unsubscribe()
    state = fold_all(seen)
    snapshot = llama_pair.decode.snapshot()
    assert state.ref_counts == snapshot["pool"]["ref_counts"] and state.free_queue == snapshot["pool"]["free_queue"]
    assert [(t.request_id, t.num_bytes) for t in state.transfers] == \
        [(t.request_id, t.num_bytes) for t in llama_pair.transfers[-2:]]


def test_seeded_sampling_and_n_forks_equal_a_single_engine(tiny_llama, llama_pair):
    params = SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=11)
    assert disaggregated(llama_pair, PROMPTS[:3], params) == \
        single_engine(tiny_llama, PROMPTS[:3], params, num_blocks=96, **CONFIG)


def test_a_bad_request_is_a_field_error_and_changes_nothing(llama_pair):
    llama_pair.add_request("dup", "Hello", GREEDY)
    cases = [("dup", "Hi", GREEDY, "request_id"), ("e", "", GREEDY, "prompt"),
             ("big", "x" * 10_000, GREEDY, "prompt"), ("beam", "Hi", SamplingParams(beam_width=2, temperature=0, max_tokens=4),
                                                      "beam_width"),
             ("plp", "Hi", SamplingParams(max_tokens=4, prompt_logprobs=1), "prompt_logprobs")]
    for rid, prompt, params, field in cases:
        with pytest.raises(FieldError) as info:
            llama_pair.add_request(rid, prompt, params)
        assert info.value.field == field
    assert list(llama_pair.waiting) == ["dup"] and [rid for rid, _ in llama_pair.new] == ["dup"]
    while llama_pair.has_unfinished_requests():
        llama_pair.step()
    llama_pair.check_invariants()


def test_a_tight_decode_pool_makes_handoffs_wait(tiny_gpt2, gpt2_tight_pair):
    seen: list = []
    unsubscribe = gpt2_tight_pair.subscribe(seen.append)
    prompts = PROMPTS + ["Another prompt, long enough to need several blocks of KV."]
    params = SamplingParams(max_tokens=24, temperature=0)
    got = disaggregated(gpt2_tight_pair, prompts, params)
    unsubscribe()
    assert got == single_engine(tiny_gpt2, prompts, params, num_blocks=30, **CONFIG)
    assert gpt2_tight_pair.num_stalls > 0                 # KV arrived before the decode pool had room
    assert any(isinstance(e, ev.Preempted) for e in seen)


def test_a_dead_prefill_worker_is_a_clear_error(gpt2_tight_pair):
    (pid,) = gpt2_tight_pair.group.pids
    gpt2_tight_pair.add_request("x", "Hello", GREEDY)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"prefill engine rank 1 \(pid {pid}\) was killed by SIGKILL"):
        gpt2_tight_pair.step()
    assert not any(p.is_alive() for p in gpt2_tight_pair.group.processes)
