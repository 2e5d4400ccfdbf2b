"""Tensor parallelism: TP=2 gives TP=1's tokens and decisions, and every rank's pool stays right.

One worker group (rank 1, a separate process) serves every TP engine of this
module, one after another: processes start once, each engine sends its shards.
Each workload makes every memory mechanism happen under a tight pool and a
small token budget: chunked prefill, prefix-cache hits, n > 1 forks with
copy-on-write, preemption by recompute or swap. `run_to_end` calls
`check_invariants()` after every step, which with TP asks every rank to check
its own KV pool against the driver's block tables (distributed/ledger.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_engine, run_to_end

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev
from nanoserve.distributed.tensor_parallel import start_workers, stop_workers

SYSTEM = "You are a helpful assistant. Answer briefly. "
PROMPTS = [SYSTEM + "What is a KV cache?", SYSTEM + "Name a colour.", "The quick brown fox jumps over " * 3,
           SYSTEM + "What is a KV cache? Say more.", "Hi"]


@pytest.fixture(scope="module")
def workers():
    group = start_workers(2)
    yield group
    stop_workers(group)
    assert not any(p.is_alive() for p in group.processes)


def add_workload(engine: LLMEngine) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=14, temperature=0))
    engine.add_request("fork", SYSTEM + "Fork me.", SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=7))


def scheduling(events) -> list:
    """The engine's decisions, without timings and without the TP events and fields (which TP=1 does not have).
    Log-probabilities are rounded: the ranks sum partial products in another order (~1e-6 apart)."""
    out = []
    for e in events:
        if isinstance(e, ev.StepFinished):
            e = dataclasses.replace(e, duration_s=0.0)
        elif isinstance(e, ev.TokenSampled):
            e = dataclasses.replace(e, logprob=round(e.logprob, 3))
        elif isinstance(e, ev.EngineSynced):          # (a subscriber's first event; TP=2 lists its ranks, its
            # settings say tensor_parallel_size=2, and its shards run llama.py's layers, not the CPU Llama)
            e = dataclasses.replace(e, ranks=(), config=(), implementation=())
        if not isinstance(e, (ev.CollectiveOps, ev.RankPoolState)):
            out.append(e)
    return out


def run(engine: LLMEngine) -> tuple[dict, list]:
    seen: list = []
    engine.subscribe(seen.append)
    add_workload(engine)
    outputs = run_to_end(engine)          # check_invariants() after every step, on every rank
    tokens = {rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()}
    return tokens, seen


CONFIG = dict(block_size=4, num_blocks=30, max_num_batched_tokens=16, max_num_seqs=6)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("model", ["tiny_gpt2", "tiny_llama"])
def test_tp2_equals_tp1(request, workers, model, mode):
    loaded = request.getfixturevalue(model)
    single, single_events = run(make_engine(loaded, preemption_mode=mode, **CONFIG))
    with LLMEngine(EngineConfig(model=loaded.name, preemption_mode=mode, tensor_parallel_size=2, **CONFIG),
                   loaded=loaded, workers=workers) as engine:
        parallel, events = run(engine)
    assert parallel == single
    assert scheduling(events) == scheduling(single_events)     # the same decisions, step by step
    # The workload really did exercise every mechanism (on every rank, through the broadcast moves).
    kinds = {type(e) for e in events}
    assert {ev.CowCopied, ev.Forked, ev.Preempted} <= kinds
    assert any(isinstance(e, ev.PrefixMatched) and e.num_hit_tokens for e in events)
    assert any(isinstance(e, ev.ChunkScheduled) and e.is_prefill and e.start > 0 for e in events)
    assert all(e.mode == mode for e in events if isinstance(e, ev.Preempted))
    reports = [e for e in events if isinstance(e, ev.RankPoolState)]
    assert {e.rank for e in reports} == {0, 1}
    assert sum(e.num_blocks_copied for e in reports if e.rank == 1) == \
        sum(1 for e in events if isinstance(e, ev.CowCopied))
    if mode == "swap":
        assert ev.SwappedOut in kinds and ev.SwappedIn in kinds
        assert any(e.num_blocks_swapped for e in reports if e.rank == 1)


def test_each_rank_holds_its_own_heads_and_the_collectives_are_counted(tiny_llama, workers):
    with LLMEngine(EngineConfig(model=tiny_llama.name, tensor_parallel_size=2, **CONFIG),
                   loaded=tiny_llama, workers=workers) as engine:
        engine.add_request("r", "Hello, world", SamplingParams(max_tokens=3, temperature=0))
        result = engine.step()
        hidden, layers = 64, tiny_llama.model.num_layers
        ops = {e.kind: e for e in result.events if isinstance(e, ev.CollectiveOps)}
        # Two all-reduces per layer (attention output, MLP down) and one for the embedding, over [T, hidden].
        assert ops["all_reduce"].count == 2 * layers + 1
        assert ops["all_reduce"].num_bytes == (2 * layers + 1) * 12 * hidden * 4
        assert ops["gather"].count == 1 and ops["broadcast"].count == 1
        states = [e for e in result.events if isinstance(e, ev.RankPoolState)]
        assert [(e.rank, e.kv_heads) for e in states] == [(0, (0,)), (1, (1,))]    # GQA: 2 KV heads, 1 per rank
        assert len({e.digest for e in states}) == 1
        k, _ = engine.runner.kv_caches[0]
        assert tuple(k.shape[2:]) == (1, tiny_llama.model.head_dim)              # rank 0 stores 1 of 2 KV heads
        assert engine.snapshot()["ranks"] == [{"rank": 0, "kv_heads": [0], "bytes_per_block": states[0].bytes_per_block},
                                              {"rank": 1, "kv_heads": [1], "bytes_per_block": states[1].bytes_per_block}]
        run_to_end(engine)


def test_the_per_rank_check_notices_a_pool_out_of_step(tiny_gpt2, workers):
    with LLMEngine(EngineConfig(model=tiny_gpt2.name, tensor_parallel_size=2, **CONFIG),
                   loaded=tiny_gpt2, workers=workers) as engine:
        engine.add_request("a", "abcdefghij", SamplingParams(max_tokens=4, temperature=0))
        engine.add_request("b", "zyxwvutsrq", SamplingParams(max_tokens=4, temperature=0))
        engine.step()
        engine.check_invariants()
        a, b = engine.sequences["a"].block_table, engine.sequences["b"].block_table
        engine.runner.local.move(("copy", [(b[0], a[0])]))    # rank 0 alone overwrites a block of "a"
        with pytest.raises(AssertionError, match="rank 0: a: position 0 should be token"):
            engine.check_invariants()
