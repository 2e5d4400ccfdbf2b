"""Tests for trace.py: the event bus, JSONL record/replay, and fold."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.events import (
    EVENT_TYPES,
    BeamPruned,
    BlockDeduplicated,
    BlocksAllocated,
    BlocksFreed,
    BlocksLeftWindow,
    ChunkScheduled,
    CollectiveOps,
    CompanionEvicted,
    CowCopied,
    DraftProposed,
    DraftVerified,
    EngineSynced,
    Forked,
    GroupsCached,
    GroupsForked,
    KVTransferred,
    KVTrimmed,
    Preempted,
    PrefixMatched,
    RadixEvicted,
    RadixInserted,
    RadixLocked,
    RadixSplit,
    RankPoolState,
    RequestAdded,
    SequenceAborted,
    SequenceAdmitted,
    SequenceFinished,
    StepFinished,
    StepStarted,
    SwappedIn,
    SwappedOut,
    TokenConstrained,
    TokenSampled,
)
from nanoserve.trace import (
    EventBus,
    JsonlRecorder,
    SequenceView,
    event_from_dict,
    event_to_dict,
    fold,
    fold_all,
    read_trace,
    write_trace,
)

# One instance of every event type, with awkward values: nested tuples,
# unicode and newlines in text, a negative float, empty tuples.
SAMPLES = [
    EngineSynced(0, "tiny-llama", 8, 4, (1, 1, 0, 0, 0, 0, 0, 0), (2, 3, 4, 5, 6, 7),
                 (("a", "running", "héllo\nworld", 5, "", 0, 4, (0, 1), 16),
                  ("b", "waiting", "x", 1, "out", 2, 0, (), 8))),
    StepStarted(1, num_waiting=1, num_running=1),
    RequestAdded(1, "c", "the prompt ✓", 3, 16),
    SequenceAdmitted(1, "b"),
    ChunkScheduled(1, "b", 0, 3, True),
    BlocksAllocated(1, "b", (2, 3)),
    BlocksFreed(1, "a", (0, 1), (1, 0)),
    Preempted(1, "a", "recompute", 4),
    TokenConstrained(1, "b", 42, 3, 257, True, False),
    TokenSampled(1, "b", 42, " 世界\t\"q\"", -0.125),
    SequenceFinished(1, "b", "abort", 3, error="out of blocks"),
    SequenceAborted(1, "c"),
    StepFinished(1, 2, 3, 1, 6, 0.0125),
    DraftProposed(2, "r1", "ngram", (5, 6, 7)),
    DraftVerified(2, "r1", 3, 1, 1, 9, False),
    KVTrimmed(2, "r1", 12, 2, (4,)),
    # memory mechanisms; an EngineSynced with 11-field requests, a radix tree and a CPU pool
    EngineSynced(3, "m", 4, 2, (2, 1, 0, 0), (2, 3), (("a", "swapped", "p", 3, "", 0, 3, (), 8, 0, (0, 1)),
                                                         ("b", "running", "p", 3, "", 0, 2, (0,), 8, 1, ())),
                 radix=((1, 0, "a \"b\"\n", 2, (0,), 2), (2, 1, "ü", 2, (1,), 3)), prefix_caching=True,
                 num_cpu_blocks=4),
    PrefixMatched(3, "b", 6, 4, (0, 1)),
    RadixInserted(3, "b", 3, 1, "✓ text\n", 4, (5, 6)),
    RadixSplit(3, 3, 4, 1, "head", "tail"),
    RadixLocked(3, "b", 3),
    RadixEvicted(4, 3, (6,), 3),
    BlockDeduplicated(4, "b", 2, 7, 5, True),
    Forked(4, "b", "b.1", (0, 1, 5)),
    CowCopied(4, "b.1", 2, 5, 8),
    BeamPruned(5, "b.1"),
    SwappedOut(5, "b", (0, 1), (1,), (2, 3)),
    SwappedIn(6, "b", (2, 3), (4, 9)),
    # across processes: a tensor-parallel engine's ranks and collectives, a disaggregated KV handoff
    EngineSynced(7, "m", 4, 2, (0, 0, 0, 0), (0, 1, 2, 3), (), ranks=((0, (0,), 512), (1, (1,), 512))),
    CollectiveOps(8, "all_reduce", 5, 1280, 0.0021),
    RankPoolState(8, 1, (1,), 512, 2, 0, 1, "0a1b2c3d4e5f"),
    RequestAdded(8, "d", "héllo", 5, 4),
    KVTransferred(8, "d", "prefill", "decode", (7, 3), (0, 1), 4, 2048, 0.0005),
    BlocksLeftWindow(9, "a", 1, 8, 17, (0, 1), (5, 6), (6,)),
    BlocksAllocated(9, "a", (7,), 2),
    GroupsCached(9, "a", (3,), ((5, 6),)),
    CompanionEvicted(9, 3, 1, 5, True),
    GroupsForked(9, "a", "a.1", ((-1, 6), (-1, 7))),
]


def test_samples_cover_every_event_type():
    assert {type(e).__name__ for e in SAMPLES} == set(EVENT_TYPES)


def test_event_to_dict_tags_type_and_uses_lists():
    d = event_to_dict(SAMPLES[0])
    assert d["type"] == "EngineSynced"
    assert d["sequences"][0][7] == [0, 1] and isinstance(d["ref_counts"], list)
    json.dumps(d)  # plain JSON data


def test_round_trip_every_event_type(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLES)
    assert read_trace(path) == SAMPLES
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(SAMPLES)


@settings(max_examples=50, deadline=None)
@given(text=st.text(), logprob=st.floats(allow_nan=False), table=st.lists(st.integers(0, 10**6)))
def test_round_trip_arbitrary_values(text, logprob, table):
    events = [TokenSampled(3, text, 7, text, logprob),
              EngineSynced(0, text, 4, 2, (0,) * 4, (0, 1, 2, 3), ((text, "waiting", text, 1, text, 0, 0, tuple(table), 4),))]
    assert [event_from_dict(json.loads(json.dumps(event_to_dict(e)))) for e in events] == events


def test_recorder_as_bus_subscriber(tmp_path):
    path = tmp_path / "rec.jsonl"
    bus = EventBus()
    with JsonlRecorder(path) as rec:
        bus.subscribe(rec)
        bus.publish(SAMPLES[0])
        assert read_trace(path) == SAMPLES[:1]  # flushed after every line
        bus.publish_many(SAMPLES[1:])
    assert read_trace(path) == SAMPLES


def test_corrupt_line_names_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_trace(path, SAMPLES[:2])
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"type": "StepStarted", "step": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3:"):
        read_trace(path)


def test_bad_fields_in_file_name_line_number(tmp_path):
    path = tmp_path / "fields.jsonl"
    path.write_text('{"type": "SequenceAdmitted", "step": 1}\n', encoding="utf-8")  # no request_id
    with pytest.raises(ValueError, match=r"fields\.jsonl:1:.*SequenceAdmitted"):
        read_trace(path)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        read_trace("/nonexistent/dir/trace.jsonl")


def test_unknown_type_and_bad_fields():
    with pytest.raises(ValueError, match="Bogus"):
        event_from_dict({"type": "Bogus", "step": 1})
    with pytest.raises(ValueError, match="type"):
        event_from_dict({"step": 1})
    with pytest.raises(ValueError, match="StepStarted"):
        event_from_dict({"type": "StepStarted", "step": 1, "num_waiting": 0, "num_running": 0, "extra": 1})
    with pytest.raises(ValueError):
        event_from_dict([1, 2])


# -- EventBus -------------------------------------------------------------------


def test_bus_order_unsubscribe_and_active():
    bus = EventBus()
    assert not bus.active
    got = []
    unsub_a = bus.subscribe(lambda e: got.append(("a", e.step)))
    unsub_b = bus.subscribe(lambda e: got.append(("b", e.step)))
    assert bus.active
    bus.publish_many([StepStarted(1, 0, 0), StepStarted(2, 0, 0)])
    assert got == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    unsub_a()
    unsub_a()  # a second call is harmless
    bus.publish(StepStarted(3, 0, 0))
    assert got[-1] == ("b", 3) and len(got) == 5
    unsub_b()
    assert not bus.active


def test_bus_subscriber_error_propagates():
    bus = EventBus()
    got = []

    def boom(e):
        raise RuntimeError("viewer broke")

    bus.subscribe(boom)
    bus.subscribe(got.append)
    with pytest.raises(RuntimeError, match="viewer broke"):
        bus.publish(StepStarted(1, 0, 0))
    assert got == []


# -- fold -----------------------------------------------------------------------


def sync(num_blocks=8, requests=()):
    return EngineSynced(0, "tiny-llama", num_blocks, 4, (0,) * num_blocks, tuple(range(num_blocks)), requests)


def test_fold_requires_sync_first():
    with pytest.raises(ValueError, match="EngineSynced"):
        fold(None, StepStarted(1, 0, 0))
    with pytest.raises(ValueError, match="EngineSynced"):
        fold_all([])


def test_fold_hand_written_sequence():
    events = [
        sync(8),
        RequestAdded(0, "r1", "Hello there", 6, 4),
        RequestAdded(0, "r2", "Hi", 2, 8),
        StepStarted(1, 2, 0),
        SequenceAdmitted(1, "r1"),
        BlocksAllocated(1, "r1", (0, 1)),
        ChunkScheduled(1, "r1", 0, 6, True),
        SequenceAdmitted(1, "r2"),
        BlocksAllocated(1, "r2", (2,)),
        ChunkScheduled(1, "r2", 0, 2, True),
        TokenSampled(1, "r1", 11, " world", -0.5),
        StepFinished(1, 2, 8, 0, 5, 0.01),
        StepStarted(2, 0, 2),
        BlocksFreed(2, "r1", (0, 1), (1, 0)),
        Preempted(2, "r1", "recompute", 7),
        ChunkScheduled(2, "r2", 2, 1, False),
        TokenSampled(2, "r2", 12, "!", -0.1),
        SequenceFinished(2, "r2", "length", 1),
        BlocksFreed(2, "r2", (2,), (2,)),
        StepFinished(2, 1, 0, 1, 8, 0.02),
    ]
    s = fold_all(events)
    assert s.step == 2 and s.model == "tiny-llama" and (s.num_blocks, s.block_size) == (8, 4)
    assert s.ref_counts == [0] * 8
    assert s.free_queue == [3, 4, 5, 6, 7, 1, 0, 2]
    assert s.waiting == ["r1"] and s.running == [] and s.finished == ["r2"]
    assert s.touched_blocks == {0, 1, 2}
    assert s.sequences["r1"] == SequenceView("r1", "Hello there", 6, 4, "waiting", " world", 1, 0, [], None)
    assert s.sequences["r2"] == SequenceView("r2", "Hi", 2, 8, "finished_length", "!", 1, 3, [], "length")
    assert s.last_step == events[-1]
    assert s.history == [(1, 8, 0, 5, 0.01), (2, 0, 1, 8, 0.02)]

    mid = fold_all(events[:12])  # after step 1
    assert mid.running == ["r1", "r2"] and mid.waiting == []
    assert mid.ref_counts[:3] == [1, 1, 1] and mid.free_queue == [3, 4, 5, 6, 7]
    assert mid.block_owners() == {0: ["r1"], 1: ["r1"], 2: ["r2"]}
    assert mid.sequences["r1"].num_computed_tokens == 6 and mid.sequences["r1"].status == "running"


def test_fold_sync_restores_live_requests():
    s = fold(None, EngineSynced(5, "m", 4, 2, (1, 2, 0, 0), (3, 2), (
        ("a", "running", "p", 3, "xy", 2, 4, (0, 1), 10),
        ("b", "waiting", "q", 1, "", 0, 0, (), 10),
        ("c", "running", "r", 1, "", 0, 1, (1,), 10),
    )))
    assert s.step == 5 and s.running == ["a", "c"] and s.waiting == ["b"]
    assert s.free_queue == [3, 2] and s.ref_counts == [1, 2, 0, 0]
    assert s.block_owners() == {0: ["a"], 1: ["a", "c"]}
    assert s.sequences["a"].output_text == "xy" and s.sequences["a"].block_table == [0, 1]
    assert s.sequences["a"].max_tokens == 10


def test_fold_preempt_goes_to_front_and_abort_is_idempotent():
    s = fold_all([sync(4), RequestAdded(0, "a", "", 1, 1), RequestAdded(0, "b", "", 1, 1),
                  RequestAdded(0, "c", "", 1, 1), SequenceAdmitted(1, "a"), Preempted(1, "a", "recompute", 1)])
    assert s.waiting == ["a", "b", "c"] and s.sequences["a"].status == "waiting"
    s = fold(s, SequenceAborted(1, "b"))
    s = fold(s, SequenceFinished(1, "b", "abort", 0))
    assert s.finished == ["b"] and s.waiting == ["a", "c"]
    assert s.sequences["b"].status == "finished_aborted" and s.sequences["b"].finish_reason == "abort"
    s = fold(s, SequenceFinished(3, "c", "stop", 0))
    assert s.sequences["c"].status == "finished_stopped" and s.step == 3


def test_step_started_clears_touched_blocks():
    s = fold_all([sync(4), RequestAdded(0, "a", "", 1, 1), SequenceAdmitted(1, "a"), BlocksAllocated(1, "a", (0,))])
    assert s.touched_blocks == {0}
    assert fold(s, StepStarted(2, 0, 1)).touched_blocks == set()


# -- fold vs a simulated pool ------------------------------------------------------


class SimPool:
    """The block pool's contract in a few lines: allocate from the head, free to the tail."""

    def __init__(self, n):
        self.ref = [0] * n
        self.free = list(range(n))

    def take(self, block_id):  # a fresh block (the head) or a revived / shared one
        if self.ref[block_id] == 0:
            self.free.remove(block_id)
        self.ref[block_id] += 1

    def release(self, block_ids):  # last block first, like BlockPool.free
        released = []
        for b in reversed(block_ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
                released.append(b)
        return tuple(released)


@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(1, 12), data=st.data())
def test_fold_pool_matches_simulation(num_blocks, data):
    rids = ["r0", "r1", "r2"]
    pool, tables = SimPool(num_blocks), {r: [] for r in rids}
    state = fold(None, sync(num_blocks, tuple((r, "running", "", 1, "", 0, 0, (), 4) for r in rids)))
    for step in range(1, data.draw(st.integers(1, 30)) + 1):
        rid = data.draw(st.sampled_from(rids))
        op = data.draw(st.sampled_from(["alloc", "revive", "share", "free"]))
        others = sorted({b for r in rids if r != rid for b in tables[r]} - set(tables[rid]))
        if op == "alloc" and pool.free:
            ids = tuple(pool.free[: data.draw(st.integers(1, len(pool.free)))])
        elif op == "revive" and pool.free:  # prefix-cache hit on a freed block anywhere in the queue
            ids = (data.draw(st.sampled_from(pool.free)),)
        elif op == "share" and others:      # fork / shared prefix: one more holder
            ids = (data.draw(st.sampled_from(others)),)
        elif op == "free" and tables[rid]:
            ids = tuple(tables[rid])
        else:
            continue
        if op == "free":
            event = BlocksFreed(step, rid, ids, pool.release(ids))
            tables[rid] = []
        else:
            for b in ids:
                pool.take(b)
            tables[rid].extend(ids)
            event = BlocksAllocated(step, rid, ids)
        state = fold(state, event)
        assert state.free_queue == pool.free
        assert state.ref_counts == pool.ref
        assert {r: state.sequences[r].block_table for r in rids} == tables
        assert state.step == step
