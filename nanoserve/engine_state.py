"""What an engine looks like from outside, and the checks that its bookkeeping is right.

`snapshot()` is the plain-data state every viewer can start from (the TUI's
`EngineSynced` event is built from it); `check_invariants()` is what the tests
call after every step. Both read the engine and change nothing.
`fold_mismatches(view, snapshot)` says where a viewer's folded state differs
from a snapshot (nothing, if the events told the whole story). `spec_stats` and
`prefix_cache_stats` sum up the engine's life as plain data too.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from nanoserve.sequence import Sequence

if TYPE_CHECKING:                      # (a type only: engine.py imports this module)
    from nanoserve.engine import LLMEngine


def prompt_text(text: str | None, token_ids: list[int], tokenizer) -> str:
    """The prompt as viewers show it: its text; for a token-id prompt, the text those ids decode to
    (special tokens included), or the ids themselves when the model has no tokenizer."""
    if text is not None:
        return text
    if tokenizer is not None:
        return tokenizer.decode(token_ids)
    return str(list(token_ids))


def snapshot(engine: LLMEngine) -> dict:
    """`engine.snapshot()`: pool, block tables, queues, radix tree and CPU pool as plain data."""
    def view(seq: Sequence) -> dict:
        return {
            "seq_id": seq.seq_id, "status": seq.status.value, "prompt": prompt_text(seq.prompt, seq.prompt_token_ids, engine.tokenizer),
            "num_prompt_tokens": seq.num_prompt_tokens, "output_text": seq.output_text,
            "num_output_tokens": seq.num_output_tokens, "num_computed_tokens": seq.num_computed_tokens,
            "block_table": list(seq.block_table), "max_tokens": seq.params.max_tokens,
            "cache_node": seq.cache_node.node_id if seq.cache_node is not None else 0,
            "cpu_block_table": list(seq.cpu_block_table),
            "grammar": seq.grammar.kind if seq.grammar is not None else "",   # structured output's kind
        }
    return {
        "step": engine.step_count,
        "model": engine.config.model,
        "pool": engine.pool.snapshot(),
        "waiting": [s.seq_id for s in engine.scheduler.waiting],
        "running": [s.seq_id for s in engine.scheduler.running],
        "swapped": [s.seq_id for s in engine.scheduler.swapped],
        "sequences": [view(s) for s in engine.sequences.values()],
        "radix": {"enabled": engine.radix is not None, "nodes": engine.radix.snapshot() if engine.radix else [],
                  # prompt tokens looked up and hit since the engine started (kv_usage.HIT_RATE)
                  "num_lookup_tokens": engine.kv.num_lookup_tokens, "num_hit_tokens": engine.kv.num_hit_tokens},
        "cpu_pool": engine.cpu_pool.snapshot() if engine.cpu_pool else None,
        "config": {f.name: getattr(engine.config, f.name) for f in dataclasses.fields(engine.config)},
        # what computes a step, as it runs (runner.Implementation): the config says what was asked for
        "implementation": engine.implementation.as_dict(),
        # tensor parallelism: each rank's KV heads and share of a block (absent for one process)
        **({"ranks": engine.runner.rank_info()} if hasattr(engine.runner, "rank_info") else {}),
    }


def check_invariants(engine: LLMEngine) -> None:
    """`engine.check_invariants()`: raise AssertionError if any bookkeeping invariant is broken."""
    engine.scheduler.check_invariants()
    if engine.proposer:
        engine.proposer.check_invariants()
        for rid, st in getattr(engine.proposer, "states", {}).items():   # a draft model's own KV
            seq = engine.sequences.get(rid)
            assert seq is not None, f"draft KV kept for {rid}, which is not an unfinished sequence"
            assert st.num_computed < seq.num_tokens, (f"draft KV of {rid} covers {st.num_computed} of its "
                                                      f"{seq.num_tokens} tokens: a proposal would have nothing to feed")
    queues = engine.scheduler.running + list(engine.scheduler.waiting) + list(engine.scheduler.swapped)
    live = {s.seq_id for s in queues}
    assert live == set(engine.sequences), f"queues {sorted(live)} != sequences {sorted(engine.sequences)}"
    for s in engine.sequences.values():   # prompt log-probabilities: one entry per computed prompt position
        if s.needs_prompt_logprobs:
            assert len(s.prompt_logprobs) >= min(s.num_computed_tokens, s.num_prompt_tokens - 1) + 1, \
                f"{s.seq_id}: {len(s.prompt_logprobs)} prompt log-probabilities for {s.num_computed_tokens} computed"
    owners = {s.request_id for s in engine.sequences.values()}
    assert owners == set(engine.requests), f"sequences' requests {sorted(owners)} != requests {sorted(engine.requests)}"
    for request in engine.requests.values():   # n > 1: the n first tokens are drawn together, then it forks
        if request.needs_fork:
            seqs = request.live
            assert len(seqs) == 1 and not seqs[0].output_token_ids and seqs[0].seats == request.params.n, (
                f"{request.request_id}: n={request.params.n} not forked yet, but its sequences are "
                f"{[(s.seq_id, s.num_output_tokens, s.seats) for s in seqs]} (one, no output, n seats expected)")
    if not engine.sequences:   # nothing runs: the only blocks in use are the prefix cache's
        cached = engine.radix.num_cached_blocks if engine.radix else 0
        assert engine.pool.num_used_blocks == cached, \
            f"{engine.pool.num_used_blocks - cached} blocks leaked with no requests"
        assert engine.cpu_pool is None or engine.cpu_pool.num_used_blocks == 0, "CPU blocks leaked"
    if hasattr(engine.runner, "check_invariants"):   # tensor parallelism: every rank checks its own pool
        engine.runner.check_invariants(engine)


def spec_stats(totals: dict) -> dict:
    """Speculative decoding from the engine's running totals (drafted, accepted, tokens, forwards)."""
    return {
        "num_drafted": totals["drafted"], "num_accepted": totals["accepted"],
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "tokens_per_forward": totals["tokens"] / totals["forwards"] if totals["forwards"] else None,
    }


def prefix_cache_stats(engine: LLMEngine) -> dict:
    """Tokens looked up at admission, tokens a hit skipped, their ratio, and the blocks cached now."""
    looked, hit = engine.kv.num_lookup_tokens, engine.kv.num_hit_tokens
    return {"num_lookup_tokens": looked, "num_hit_tokens": hit, "hit_rate": hit / looked if looked else None,
            "num_cached_blocks": engine.radix.num_cached_blocks if engine.radix else 0}


def fold_mismatches(state, snap: dict) -> list[str]:
    """Every difference between a folded view and `engine.snapshot()`; empty when they agree."""
    out = []

    def same(what, got, want):
        if got != want:
            out.append(f"{what}: fold {got!r} != engine {want!r}")

    pool = snap["pool"]
    same("ref counts", state.ref_counts, pool["ref_counts"])
    same("free queue", state.free_queue, pool["free_queue"])
    for queue in ("running", "waiting", "swapped"):
        same(queue, getattr(state, queue), snap[queue])
    live = sorted(rid for rid, v in state.sequences.items() if not v.status.startswith("finished"))
    same("live sequences", live, sorted(r["seq_id"] for r in snap["sequences"]))
    for r in snap["sequences"]:
        view = state.sequences.get(r["seq_id"])
        if view is None:
            continue
        for name in ("status", "block_table", "num_computed_tokens", "num_output_tokens", "output_text",
                     "cache_node", "cpu_block_table", "num_prompt_tokens", "max_tokens"):
            same(f"{r['seq_id']}.{name}", getattr(view, name), r[name])
    if snap["radix"]["enabled"]:
        nodes = {n["node_id"]: (n["parent_id"], n["block_ids"], n["num_tokens"], n["lock_count"])
                 for n in snap["radix"]["nodes"]}
        locks = state.lock_counts()
        folded = {n.node_id: (n.parent_id, n.block_ids, n.num_tokens, locks[n.node_id]) for n in state.radix_nodes()}
        same("radix tree", folded, nodes)
    return out
