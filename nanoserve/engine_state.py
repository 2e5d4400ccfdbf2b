"""What an engine looks like from outside, and the checks that its bookkeeping is right.

`snapshot()` is the plain-data state every viewer can start from (the TUI's
`EngineSynced` event is built from it); `check_invariants()` is what the tests
call after every step. Both read the parts they are given (never the engine itself: engine.py
imports this module) and change nothing.
`fold_mismatches(view, snapshot)` says where a viewer's folded state differs
from a snapshot (nothing, if the events told the whole story). `spec_stats` and
`prefix_cache_stats` sum up the engine's life as plain data too.
"""

from __future__ import annotations

import dataclasses

from nanoserve.block_pool import BlockPool
from nanoserve.config import EngineConfig
from nanoserve.kv_manager import KVManager
from nanoserve.radix_cache import RadixCache
from nanoserve.request_table import RequestTable, prompt_text
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence


def snapshot(table: RequestTable, scheduler: Scheduler, kv: KVManager, pool: BlockPool, radix: RadixCache | None,
             cpu_pool: BlockPool | None, config: EngineConfig, implementation, ranks: list | None = None) -> dict:
    """`engine.snapshot()`: pool, block tables, queues, radix tree and CPU pool as plain data.
    (`implementation` is the runner's `Implementation`; `ranks`, tensor parallelism's per-rank shares.)"""
    def view(seq: Sequence) -> dict:
        return {
            "seq_id": seq.seq_id, "status": seq.status.value, "prompt": prompt_text(seq.prompt, seq.prompt_token_ids, table.tokenizer),
            "num_prompt_tokens": seq.num_prompt_tokens, "output_text": seq.output_text,
            "num_output_tokens": seq.num_output_tokens, "num_computed_tokens": seq.num_computed_tokens,
            "block_table": list(seq.block_table), "max_tokens": seq.params.max_tokens,
            "cache_node": seq.cache_node.node_id if seq.cache_node is not None else 0,
            "cpu_block_table": list(seq.cpu_block_table),
            "grammar": seq.grammar.kind if seq.grammar is not None else "",   # structured output's kind
            # KV cache groups 1.. (kv_groups.py; empty with one group), FREED entries -1
            "group_tables": [list(t) for t in seq.group_tables],
            "cpu_group_tables": [list(t) for t in seq.cpu_group_tables],
        }
    return {
        "step": table.clock.step,
        "model": config.model,
        "pool": pool.snapshot(),
        "waiting": [s.seq_id for s in scheduler.waiting],
        "running": [s.seq_id for s in scheduler.running],
        "swapped": [s.seq_id for s in scheduler.swapped],
        "sequences": [view(s) for s in table.sequences.values()],
        "radix": {"enabled": radix is not None, "nodes": radix.snapshot() if radix else [],
                  # prompt tokens looked up and hit since the engine started (kv_usage.HIT_RATE)
                  "num_lookup_tokens": kv.num_lookup_tokens, "num_hit_tokens": kv.num_hit_tokens,
                  # KV cache groups: group 0's cached block -> its companions in groups 1.., held for the tree
                  "companions": [[b, list(c)] for b, c in kv.group_cache.companions.items()]},
        # KV cache groups (kv_groups.py): each one's window (0: full attention) and layers, group 0 first
        "kv_groups": [[g.window or 0, list(g.layers)] for g in kv.groups],
        "cpu_pool": cpu_pool.snapshot() if cpu_pool else None,
        "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
        # what computes a step, as it runs (runner.Implementation): the config says what was asked for
        "implementation": implementation.as_dict(),
        # tensor parallelism: each rank's KV heads and share of a block (absent for one process)
        **({"ranks": ranks} if ranks is not None else {}),
    }


def check_invariants(table: RequestTable, scheduler: Scheduler, pool: BlockPool, radix: RadixCache | None,
                     cpu_pool: BlockPool | None, runner=None) -> None:
    """`engine.check_invariants()`: raise AssertionError if any bookkeeping invariant is broken. (`runner`:
    a tensor-parallel runner also checks every rank's pool against the block tables.)"""
    scheduler.check_invariants()
    proposer = table.proposer
    if proposer:
        proposer.check_invariants()
        for rid, st in getattr(proposer, "states", {}).items():   # a draft model's own KV
            seq = table.sequences.get(rid)
            assert seq is not None, f"draft KV kept for {rid}, which is not an unfinished sequence"
            assert st.num_computed < seq.num_tokens, (f"draft KV of {rid} covers {st.num_computed} of its "
                                                      f"{seq.num_tokens} tokens: a proposal would have nothing to feed")
    queues = scheduler.running + list(scheduler.waiting) + list(scheduler.swapped)
    live = {s.seq_id for s in queues}
    assert live == set(table.sequences), f"queues {sorted(live)} != sequences {sorted(table.sequences)}"
    for s in table.sequences.values():   # prompt log-probabilities: one entry per computed prompt position
        if s.needs_prompt_logprobs:
            assert len(s.prompt_logprobs) >= min(s.num_computed_tokens, s.num_prompt_tokens - 1) + 1, \
                f"{s.seq_id}: {len(s.prompt_logprobs)} prompt log-probabilities for {s.num_computed_tokens} computed"
    owners = {s.request_id for s in table.sequences.values()}
    assert owners == set(table.requests), f"sequences' requests {sorted(owners)} != requests {sorted(table.requests)}"
    for request in table.requests.values():   # n > 1: the n first tokens are drawn together, then it forks
        if request.needs_fork:
            seqs = request.live
            assert len(seqs) == 1 and not seqs[0].output_token_ids and seqs[0].seats == request.params.n, (
                f"{request.request_id}: n={request.params.n} not forked yet, but its sequences are "
                f"{[(s.seq_id, s.num_output_tokens, s.seats) for s in seqs]} (one, no output, n seats expected)")
    if not table.sequences:   # nothing runs: the only blocks in use are the prefix cache's
        cached = radix.num_cached_blocks + scheduler.kv.group_cache.num_blocks if radix else 0   # (+ companions)
        assert pool.num_used_blocks == cached, \
            f"{pool.num_used_blocks - cached} blocks leaked with no requests"
        assert cpu_pool is None or cpu_pool.num_used_blocks == 0, "CPU blocks leaked"
    if hasattr(runner, "check_invariants"):   # tensor parallelism: every rank checks its own pool
        runner.check_invariants(scheduler, radix)


def spec_stats(totals: dict) -> dict:
    """Speculative decoding from the engine's running totals (drafted, accepted, tokens, forwards)."""
    return {
        "num_drafted": totals["drafted"], "num_accepted": totals["accepted"],
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "tokens_per_forward": totals["tokens"] / totals["forwards"] if totals["forwards"] else None,
    }


def prefix_cache_stats(kv: KVManager, radix: RadixCache | None) -> dict:
    """Tokens looked up at admission, tokens a hit skipped, their ratio, and the blocks cached now."""
    looked, hit = kv.num_lookup_tokens, kv.num_hit_tokens
    return {"num_lookup_tokens": looked, "num_hit_tokens": hit, "hit_rate": hit / looked if looked else None,
            "num_cached_blocks": radix.num_cached_blocks if radix else 0}


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
        for name in ("group_tables", "cpu_group_tables"):   # (no live entry left: no tables)
            same(f"{r['seq_id']}.{name}", _tables(getattr(view, name)), _tables(r.get(name, [])))
    if snap["radix"]["enabled"]:
        nodes = {n["node_id"]: (n["parent_id"], n["block_ids"], n["num_tokens"], n["lock_count"])
                 for n in snap["radix"]["nodes"]}
        locks = state.lock_counts()
        folded = {n.node_id: (n.parent_id, n.block_ids, n.num_tokens, locks[n.node_id]) for n in state.radix_nodes()}
        same("radix tree", folded, nodes)
        same("companions", state.companions, {b: list(c) for b, c in snap["radix"].get("companions", [])})
    return out


def _tables(tables: list[list[int]]) -> list[list[int]]:
    """Group tables as compared: none at all when no entry is live (a sequence that let go of them)."""
    return [list(t) for t in tables] if any(b >= 0 for t in tables for b in t) else []
