"""fold() for the memory mechanisms: radix prefix cache, copy-on-write fork, swap preemption.

Each test folds the hand-written trace of `memory_events.py` up to one step
(or feeds a few events of one kind) and checks the pool (ref counts, free
queue), the block tables, the tree's shape and the lock counts. The last
tests check the JSONL round trip of every new event type and the snapshot
conversion (old and new shapes).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_events import events_through, memory_trace

from nanoserve.events import (
    BeamPruned,
    BlockDeduplicated,
    BlocksAllocated,
    CowCopied,
    EngineSynced,
    Forked,
    Preempted,
    PrefixMatched,
    RadixEvicted,
    RadixInserted,
    RadixLocked,
    RadixSplit,
    RequestAdded,
    SequenceAdmitted,
    SequenceFinished,
    StepStarted,
    SwappedIn,
    SwappedOut,
)
from nanoserve.trace import RadixNodeView, ViewState, fold, fold_all, read_trace, synced_event, write_trace


def at(step: int) -> ViewState:
    return fold_all(events_through(step))


def tree(state: ViewState) -> dict[int, tuple[int, list[int], list[int]]]:
    """Node id -> (parent, blocks, children), the root included."""
    return {n: (v.parent_id, v.block_ids, v.children) for n, v in state.radix.items()}


def refs(state: ViewState, n: int = 12) -> list[int]:
    return state.ref_counts[:n]


def test_sync_starts_with_an_empty_tree():
    s = at(0)
    assert s.prefix_caching and s.num_cpu_blocks == 6
    assert tree(s) == {0: (-1, [], [])} and s.radix_nodes() == [] and s.lock_counts() == {}
    assert s.cache_hit_rate() is None


def test_miss_then_insert_and_lock():
    s = at(1)
    assert refs(s) == [2, 2, 1] + [0] * 9          # blocks 0 1: r1's table + the tree
    assert s.free_queue == list(range(3, 12))
    assert tree(s) == {0: (-1, [], [1]), 1: (0, [0, 1], [])}
    node = s.radix[1]
    assert (node.text, node.num_tokens, node.last_access) == ("You are a helpful bot.", 8, 1)
    assert s.sequences["r1"].cache_node == 1 and s.lock_counts() == {1: 1}
    assert (s.cache_hit_tokens, s.cache_lookup_tokens) == (0, 10) and s.cache_hit_rate() == 0
    assert s.inserted_nodes == {1} and s.hit_nodes == set()
    assert s.cached_blocks() == {0: 1, 1: 1} and s.evictable_blocks() == set()


def test_prefix_hit_shares_cached_blocks():
    s = at(2)
    r2 = s.sequences["r2"]
    assert r2.block_table == [0, 1, 3] and r2.num_computed_tokens == 11
    assert refs(s)[:4] == [3, 3, 1, 1] and s.free_queue == list(range(4, 12))
    assert s.hit_nodes == {1} and s.inserted_nodes == set()        # marks were cleared at StepStarted
    assert s.radix[1].last_access == 2 and s.lock_counts() == {1: 2}
    assert s.cache_hit_rate() == pytest.approx(8 / 21)
    assert s.cache_history == [(1, 0, 10), (2, 8, 21)]
    assert s.touched_blocks == {0, 1, 3}


def test_fork_shares_every_block():
    s = fold_all(events_through(2) + [StepStarted(3, 0, 2), Forked(3, "r2", "r2.1", (0, 1, 3))])
    child, parent = s.sequences["r2.1"], s.sequences["r2"]
    assert child.block_table == [0, 1, 3] and child.block_table is not parent.block_table
    assert (child.prompt, child.status, child.num_computed_tokens, child.output_text, child.cache_node) == \
        (parent.prompt, "running", 11, parent.output_text, 1)
    assert s.running == ["r1", "r2", "r2.1"]
    assert refs(s)[:4] == [4, 4, 1, 2] and s.lock_counts() == {1: 3}
    assert s.touched_blocks == {0, 1, 3}


def test_cow_dedup_and_new_nodes():
    events = events_through(2) + [StepStarted(3, 0, 2), Forked(3, "r2", "r2.1", (0, 1, 3)),
                                  CowCopied(3, "r2.1", 2, 3, 4)]
    s = fold_all(events)
    assert s.sequences["r2.1"].block_table == [0, 1, 4] and s.sequences["r2"].block_table == [0, 1, 3]
    assert refs(s)[3:5] == [1, 1] and 4 not in s.free_queue
    s = at(3)
    assert s.sequences["r2.1"].block_table == [0, 1, 3]                 # the copy was the same as block 3
    assert refs(s)[:5] == [4, 4, 2, 3, 0] and s.free_queue == list(range(5, 12)) + [4]
    assert tree(s) == {0: (-1, [], [1]), 1: (0, [0, 1], [2, 3]), 2: (1, [2], []), 3: (1, [3], [])}
    assert s.lock_counts() == {1: 3, 2: 1, 3: 2}
    assert s.inserted_nodes == {2, 3} and {3, 4} <= s.touched_blocks
    assert [n.node_id for n in s.radix_nodes()] == [1, 2, 3]


def test_swap_out_keeps_cached_blocks_and_fills_the_cpu_pool():
    s = at(4)
    r1 = s.sequences["r1"]
    assert s.swapped == ["r1"] and "r1" not in s.running and r1.status == "swapped"
    assert r1.block_table == [] and r1.cpu_block_table == [0, 1, 2] and r1.num_computed_tokens == 12
    assert s.cpu_blocks_used() == 3
    assert refs(s)[:7] == [3, 3, 1, 3, 0, 1, 1]                       # the tree still holds r1's blocks
    assert s.lock_counts() == {1: 2, 2: 0, 3: 2}
    assert s.evictable_blocks() == {2}                               # node 2: unlocked, only the tree holds it


def test_prune_evict_swap_in_and_split():
    s = at(5)
    assert s.sequences["r2.1"].status == "finished_pruned" and s.sequences["r2.1"].finish_reason == "pruned"
    assert "r2.1" in s.finished and "r2.1" not in s.running
    r1 = s.sequences["r1"]
    assert r1.block_table == [7, 8, 9] and r1.cpu_block_table == [] and r1.status == "running"
    assert s.swapped == [] and s.running == ["r2", "r1", "r3"]
    # node 2 went; node 1 was cut: node 4 holds block 0 and is node 1's parent
    assert tree(s) == {0: (-1, [], [4]), 4: (0, [0], [1]), 1: (4, [1], [3]), 3: (1, [3], [])}
    assert (s.radix[4].text, s.radix[4].num_tokens, s.radix[1].text, s.radix[1].num_tokens) == \
        ("You are ", 4, "a helpful bot.", 4)
    assert list(s.evicted_nodes) == [2] and s.evicted_nodes[2].last_access == 3
    assert s.hit_nodes == {4} and s.radix[4].last_access == 5
    assert s.lock_counts() == {4: 2, 1: 1, 3: 1}
    assert refs(s) == [3, 2, 0, 2, 0, 1, 0, 1, 1, 1, 1, 0]
    assert s.free_queue == [11, 4, 6, 2]
    assert s.cache_hit_rate() == pytest.approx(12 / 27)


def test_finish_releases_locks_and_leaves_evictable_blocks():
    s = at(6)
    assert s.lock_counts() == {4: 1, 1: 0, 3: 0}
    assert s.evictable_blocks() == {1, 3} and s.free_queue == [11, 4, 6, 2, 5]
    assert [(n.node_id, n.parent_id) for n in s.radix_nodes()] == [(4, 0), (1, 4), (3, 1)]


def test_finished_request_holds_no_lock_even_without_radix_locked():
    s = fold_all(events_through(1) + [SequenceFinished(2, "r1", "stop", 1)])
    assert s.sequences["r1"].cache_node == 0 and s.lock_counts() == {1: 0}


def test_recompute_preemption_releases_the_lock():
    s = fold_all(events_through(1) + [Preempted(2, "r1", "recompute", 10)])
    assert s.waiting == ["r1", "r2"] and s.sequences["r1"].num_computed_tokens == 0 and s.lock_counts() == {1: 0}


def test_split_keeps_marks_and_lock_paths():
    s = fold_all(events_through(1) + [RadixSplit(1, 1, 9, 1, "You are ", "a helpful bot.")])
    assert s.inserted_nodes == {1, 9} and s.lock_counts() == {9: 1, 1: 1}
    assert s.radix_path(1) == [9, 1] and s.radix[9].last_access == 1


def test_dedup_not_released_keeps_the_block_out_of_the_free_queue():
    s = fold_all(events_through(2) + [Forked(3, "r2", "r2.1", (0, 1, 3)),
                                      BlockDeduplicated(3, "r2", 2, 3, 1, False)])
    assert s.sequences["r2"].block_table == [0, 1, 1]
    assert refs(s)[:4] == [4, 5, 1, 1] and 3 not in s.free_queue


def test_fork_of_a_waiting_request_waits_and_unknown_parent_fails():
    s = fold_all(events_through(1) + [RequestAdded(1, "w", "p", 1, 2), Forked(1, "w", "w.1", ())])
    assert s.waiting == ["r2", "w", "w.1"] and s.sequences["w.1"].status == "waiting"
    with pytest.raises(ValueError, match="unknown request 'nope'"):
        fold(s, Forked(1, "nope", "x", ()))
    with pytest.raises(ValueError, match="unknown request 'ghost'"):
        fold(s, CowCopied(1, "ghost", 0, 1, 2))


def test_evicted_blocks_join_the_free_queue_in_order():
    s = fold_all(events_through(1) + [RadixInserted(1, "r1", 5, 1, "more", 8, (2, 3)), RadixLocked(1, "r1", 0)])
    s = fold(s, SequenceFinished(2, "r1", "stop", 1))
    s.ref_counts[0:4] = [1, 1, 1, 2]     # as if r1's BlocksFreed had run: only the tree holds 0 1 2, 3 once more
    s = fold(s, RadixEvicted(2, 5, (3, 2), 1))
    assert 5 not in s.radix and s.radix[1].children == [] and s.free_queue[-2:] == [3, 2]
    assert s.ref_counts[2:4] == [0, 1]


# -- a small simulation: fork / copy-on-write / swap against plain bookkeeping ---------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fork_cow_swap_matches_simulation(data):
    n = 10
    ref, free, tables, swapped = [0] * n, list(range(n)), {"a": []}, set()
    s = fold_all([EngineSynced(0, "m", n, 2, (0,) * n, tuple(range(n)), (), num_cpu_blocks=8),
                  RequestAdded(0, "a", "p", 2, 4), SequenceAdmitted(1, "a")])
    for step in range(1, 25):
        rid = data.draw(st.sampled_from(sorted(tables)))
        op = data.draw(st.sampled_from(["alloc", "fork", "cow", "swap"]))
        if rid in swapped:
            if len(free) < 2:
                continue
            ids = tuple(free[:2])
            for b in ids:
                free.remove(b)
                ref[b] = 1
            event, tables[rid] = SwappedIn(step, rid, (0, 1), ids), list(ids)
            swapped.discard(rid)
        elif op == "alloc" and free:
            b = free.pop(0)
            ref[b] += 1
            event = BlocksAllocated(step, rid, (b,))
            tables[rid].append(b)
        elif op == "fork" and len(tables) < 5:
            child = f"{rid}.{len(tables)}"
            for b in tables[rid]:
                ref[b] += 1
            event, tables[child] = Forked(step, rid, child, tuple(tables[rid])), list(tables[rid])
        elif op == "cow" and free and any(ref[b] > 1 for b in tables[rid]):
            i = next(i for i, b in enumerate(tables[rid]) if ref[b] > 1)
            src, dst = tables[rid][i], free.pop(0)
            ref[src] -= 1
            ref[dst] = 1
            tables[rid][i] = dst
            event = CowCopied(step, rid, i, src, dst)
        elif op == "swap" and len(tables[rid]) == 2:
            s = fold(s, Preempted(step, rid, "swap", 0))
            released = []
            for b in tables[rid]:
                ref[b] -= 1
                if ref[b] == 0:
                    free.append(b)
                    released.append(b)
            event = SwappedOut(step, rid, tuple(tables[rid]), tuple(released), (0, 1))
            tables[rid], _ = [], swapped.add(rid)
        else:
            continue
        s = fold(s, event)
        assert s.ref_counts == ref and s.free_queue == free
        assert {r: s.sequences[r].block_table for r in tables} == tables
        assert set(s.swapped) == swapped


# -- JSONL and snapshots ---------------------------------------------------------------------------


def test_jsonl_round_trip_of_every_memory_event(tmp_path):
    events = memory_trace()
    path = tmp_path / "memory.jsonl"
    write_trace(path, events)
    assert read_trace(path) == events
    kinds = {type(e).__name__ for e in events}
    assert {"PrefixMatched", "RadixInserted", "RadixSplit", "RadixLocked", "RadixEvicted", "BlockDeduplicated",
            "Forked", "CowCopied", "BeamPruned", "SwappedOut", "SwappedIn"} <= kinds
    assert fold_all(read_trace(path)) == fold_all(events)


def snapshot_of(state: ViewState) -> dict:
    """What engine.snapshot() returns for this state (the shape the engine promises)."""
    locks = state.lock_counts()

    def req(r):
        return {"seq_id": r.seq_id, "status": r.status, "prompt": r.prompt,
                "num_prompt_tokens": r.num_prompt_tokens, "output_text": r.output_text,
                "num_output_tokens": r.num_output_tokens, "num_computed_tokens": r.num_computed_tokens,
                "block_table": r.block_table, "max_tokens": r.max_tokens, "cache_node": r.cache_node,
                "cpu_block_table": r.cpu_block_table}
    live = state.running + state.waiting + state.swapped
    return {
        "step": state.step, "model": state.model,
        "pool": {"num_blocks": state.num_blocks, "block_size": state.block_size,
                 "ref_counts": state.ref_counts, "free_queue": state.free_queue},
        "waiting": state.waiting, "running": state.running, "swapped": state.swapped,
        "sequences": [req(state.sequences[rid]) for rid in live],
        "radix": {"enabled": state.prefix_caching, "nodes": [
            {"node_id": n.node_id, "parent_id": n.parent_id, "text": n.text, "num_tokens": n.num_tokens,
             "block_ids": n.block_ids, "lock_count": locks[n.node_id], "last_access": n.last_access}
            for n in state.radix_nodes()]},
        "cpu_pool": {"num_blocks": state.num_cpu_blocks, "ref_counts": [0] * state.num_cpu_blocks,
                     "free_queue": []},
    }


@pytest.mark.parametrize("step", [3, 4, 5])
def test_synced_snapshot_rebuilds_tree_queues_and_locks(step):
    s = at(step)
    back = fold(None, synced_event(snapshot_of(s)))
    assert back.radix == s.radix and back.lock_counts() == s.lock_counts()
    assert (back.running, back.waiting, back.swapped) == (s.running, s.waiting, s.swapped)
    assert back.ref_counts == s.ref_counts and back.free_queue == s.free_queue
    assert back.prefix_caching and back.num_cpu_blocks == 6
    for rid in s.running + s.waiting + s.swapped:
        a, b = back.sequences[rid], s.sequences[rid]
        assert (a.block_table, a.cache_node, a.cpu_block_table) == (b.block_table, b.cache_node, b.cpu_block_table)


def test_old_snapshot_and_nine_field_requests_still_load():
    old = {"step": 2, "model": "m", "pool": {"num_blocks": 4, "block_size": 2, "ref_counts": [1, 0, 0, 0],
                                              "free_queue": [1, 2, 3]},
           "waiting": [], "running": ["a"],
           "sequences": [{"seq_id": "a", "status": "running", "prompt": "p", "num_prompt_tokens": 2,
                         "output_text": "", "num_output_tokens": 0, "num_computed_tokens": 2, "block_table": [0],
                         "max_tokens": 4}]}
    e = synced_event(old)
    assert e.radix == () and not e.prefix_caching and e.num_cpu_blocks == 0
    assert e.sequences[0][9:] == (0, ())
    s = fold(None, EngineSynced(0, "m", 4, 2, (1, 0, 0, 0), (1, 2, 3),
                                (("a", "running", "p", 2, "", 0, 2, (0,), 4),)))
    assert s.sequences["a"].cache_node == 0 and s.sequences["a"].cpu_block_table == [] and s.radix_nodes() == []


def test_radix_node_view_defaults():
    assert RadixNodeView(3, 0, "t", 4, [1]).children == [] and BeamPruned(1, "x").seq_id == "x"
    assert PrefixMatched(1, "a", 3, 0, ()).block_ids == () and RadixLocked(1, "a", 0).node_id == 0


# -- the fold agrees with a live engine's own snapshot, step after step ----------------------------

SYSTEM = "You are a helpful assistant. Answer briefly and politely. "


@pytest.mark.parametrize("config, requests, fork_at, expect", [
    (dict(num_blocks=24), [("r0", "Hi", {}), ("r1", "What is up?", {}), ("r2", "Hi", {})], None,
     {"RadixSplit", "RadixEvicted", "Preempted"}),
    (dict(num_blocks=24, preemption_mode="swap"), [("r0", "Hi", {}), ("r1", "Tell me a joke", {}),
                                                   ("r2", "Hi", {})], None, {"SwappedOut", "SwappedIn"}),
    (dict(num_blocks=48), [("r0", "Hello", {"n": 2, "temperature": 0.8})], 2, {"Forked", "CowCopied"}),
    (dict(num_blocks=60, max_num_seqs=8), [("b", "Hi", {"beam_width": 3, "temperature": 0})], None,
     {"Forked", "BeamPruned"}),
])
def test_fold_matches_engine_snapshots(config, requests, fork_at, expect):
    from nanoserve import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, max_num_batched_tokens=32,
                                    max_num_seqs=config.pop("max_num_seqs", 4), **config))
    events = []
    engine.subscribe(events.append)
    for rid, prompt, params in requests:
        engine.add_request(rid, SYSTEM + prompt, SamplingParams(max_tokens=10, ignore_eos=True, **params))
    while engine.has_unfinished_requests():
        if engine.step_count == fork_at:
            engine.fork(engine.snapshot()["running"][0])
        engine.step()
        state, snap = fold_all(events), fold(None, synced_event(engine.snapshot()))
        assert (state.ref_counts, state.free_queue) == (snap.ref_counts, snap.free_queue)
        assert (state.running, state.waiting, state.swapped) == (snap.running, snap.waiting, snap.swapped)
        assert state.radix == snap.radix and state.lock_counts() == snap.lock_counts()
        for rid in snap.running + snap.waiting + snap.swapped:
            a, b = state.sequences[rid], snap.sequences[rid]
            assert (a.block_table, a.cpu_block_table, a.cache_node, a.num_computed_tokens, a.status) == \
                (b.block_table, b.cpu_block_table, b.cache_node, b.num_computed_tokens, b.status)
    kinds = {type(e).__name__ for e in events}
    assert {"RadixInserted", "PrefixMatched"} | expect <= kinds, expect - kinds
    assert not state.running and not state.swapped and state.lock_counts() == dict.fromkeys(state.lock_counts(), 0)
