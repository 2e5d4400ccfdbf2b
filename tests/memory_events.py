"""A hand-written trace in which every memory mechanism happens once (shared by the viewer tests).

12 blocks of 4 tokens, prefix caching on, a CPU pool of 6 blocks:

step 1  r1 misses the cache, prefills 10 tokens; its 2 full blocks become node 1
step 2  r2 hits node 1 (8 of 11 tokens), allocates block 3 for the rest
step 3  r2 forks r2.1 (blocks 0 1 3 shared); r2.1 writes into shared block 3: copy-on-write
        to block 4; r1's block 2 and r2's block 3 fill up: nodes 2 and 3; r2.1's copy turns out
        equal to block 3: deduplicated, block 4 is free again
step 4  r1 is swapped out to CPU blocks 0 1 2 (nothing freed: the tree holds its blocks);
        r2 and r2.1 get blocks 5 and 6
step 5  beam r2.1 is pruned; node 2 (unlocked, ref 1) is evicted; r1 swaps back into 7 8 9;
        r3 matches only node 1's first block: node 1 is split (new node 4 = its head)
step 6  r2 finishes: nodes 1 and 3 become evictable
"""

from __future__ import annotations

from nanoserve.events import (
    BeamPruned,
    BlockDeduplicated,
    BlocksAllocated,
    BlocksFreed,
    ChunkScheduled,
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
    StepFinished,
    StepStarted,
    SwappedIn,
    SwappedOut,
    TokenSampled,
)

NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS = 12, 4, 6


def token(step, rid, text=" x"):
    return TokenSampled(step, rid, 7, text, -0.5)


def memory_steps() -> list[list]:
    """[prelude, step 1, ..., step 6]: each step's events, StepStarted to StepFinished."""
    prelude = [
        EngineSynced(0, "synthetic", NUM_BLOCKS, BLOCK_SIZE, (0,) * NUM_BLOCKS, tuple(range(NUM_BLOCKS)), (),
                     prefix_caching=True, num_cpu_blocks=NUM_CPU_BLOCKS),
        RequestAdded(0, "r1", "You are a helpful bot. Hi", 10, 6),
    ]
    step1 = [
        StepStarted(1, 1, 0),
        PrefixMatched(1, "r1", 10, 0, ()),
        SequenceAdmitted(1, "r1"),
        BlocksAllocated(1, "r1", (0, 1, 2)),
        ChunkScheduled(1, "r1", 0, 10, True),
        RadixInserted(1, "r1", 1, 0, "You are a helpful bot.", 8, (0, 1)),
        RadixLocked(1, "r1", 1),
        token(1, "r1", " Hello"),
        StepFinished(1, 1, 10, 0, 9, 0.01),
        RequestAdded(1, "r2", "You are a helpful bot. Tell", 11, 4),
    ]
    step2 = [
        StepStarted(2, 1, 1),
        PrefixMatched(2, "r2", 11, 8, (0, 1)),
        SequenceAdmitted(2, "r2"),
        RadixLocked(2, "r2", 1),
        BlocksAllocated(2, "r2", (3,)),
        ChunkScheduled(2, "r2", 8, 3, True),
        ChunkScheduled(2, "r1", 10, 1, False),
        token(2, "r1"), token(2, "r2", " me"),
        StepFinished(2, 2, 3, 1, 8, 0.01),
    ]
    step3 = [
        StepStarted(3, 0, 2),
        Forked(3, "r2", "r2.1", (0, 1, 3)),
        ChunkScheduled(3, "r1", 11, 1, False),
        ChunkScheduled(3, "r2", 11, 1, False),
        CowCopied(3, "r2.1", 2, 3, 4),
        ChunkScheduled(3, "r2.1", 11, 1, False),
        RadixInserted(3, "r1", 2, 1, " Hi Hello x", 4, (2,)),
        RadixLocked(3, "r1", 2),
        RadixInserted(3, "r2", 3, 1, " Tell me", 4, (3,)),
        RadixLocked(3, "r2", 3),
        BlockDeduplicated(3, "r2.1", 2, 4, 3, True),
        RadixLocked(3, "r2.1", 3),
        token(3, "r1"), token(3, "r2"), token(3, "r2.1"),
        StepFinished(3, 3, 0, 3, 7, 0.01),
        RequestAdded(3, "r3", "You are wrong", 6, 3),
    ]
    step4 = [
        StepStarted(4, 1, 3),
        Preempted(4, "r1", "swap", 0),
        RadixLocked(4, "r1", 0),
        SwappedOut(4, "r1", (0, 1, 2), (), (0, 1, 2)),
        BlocksAllocated(4, "r2", (5,)),
        BlocksAllocated(4, "r2.1", (6,)),
        ChunkScheduled(4, "r2", 12, 1, False),
        ChunkScheduled(4, "r2.1", 12, 1, False),
        token(4, "r2"), token(4, "r2.1"),
        StepFinished(4, 2, 0, 2, 6, 0.01),
    ]
    step5 = [
        StepStarted(5, 1, 2),
        BeamPruned(5, "r2.1"),
        RadixLocked(5, "r2.1", 0),
        BlocksFreed(5, "r2.1", (6, 3, 1, 0), (6,)),
        RadixEvicted(5, 2, (2,), 3),
        SwappedIn(5, "r1", (0, 1, 2), (7, 8, 9)),
        RadixSplit(5, 1, 4, 1, "You are ", "a helpful bot."),
        PrefixMatched(5, "r3", 6, 4, (0,)),
        SequenceAdmitted(5, "r3"),
        RadixLocked(5, "r3", 4),
        BlocksAllocated(5, "r3", (10,)),
        ChunkScheduled(5, "r3", 4, 2, True),
        ChunkScheduled(5, "r2", 13, 1, False),
        token(5, "r2"), token(5, "r3"),
        StepFinished(5, 2, 2, 1, 5, 0.01),
    ]
    step6 = [
        StepStarted(6, 0, 3),
        SequenceFinished(6, "r2", "length", 4),
        RadixLocked(6, "r2", 0),
        BlocksFreed(6, "r2", (5, 3, 1, 0), (5,)),
        StepFinished(6, 0, 2, 2, 6, 0.01),
    ]
    return [prelude, step1, step2, step3, step4, step5, step6]


def memory_trace() -> list:
    return [e for step in memory_steps() for e in step]


def events_through(step: int) -> list:
    """The trace up to the end of `step` (0: the prelude only)."""
    return [e for group in memory_steps()[:step + 1] for e in group]


def memory_state(step: int):
    """The view state at the end of `step`."""
    from nanoserve.trace import fold_all
    return fold_all(events_through(step))
