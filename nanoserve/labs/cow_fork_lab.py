"""Lab cow-fork: forking a sequence by sharing its blocks, and copy-on-write (nanoserve/kv_manager.py).

The student writes `KVManager._shared_write_block`, `copy_on_write` and
`fork`. A fork shares every block of its parent (ref count + 1, nothing
copied). Full blocks are never written again, so sharing them is free
forever; the partly filled last block is written by both, so the first one to
write gets its own copy (and the runner copies the KV into it before the
forward). The first checks call each function on sequences and a pool the
check sets up (the pool and the sequences are the engine's, in the checker;
the KV manager is the student's), in the order the functions build on each
other; then the real engine forks requests at a partial block and at a block
boundary, and the tables, ref counts, copies handed to the runner and tokens
are compared with the engine's own.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.events import CowCopied, Forked, RadixLocked, StepClock
from nanoserve.kv_manager import BlockMoves
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import TINY, prompts, reference_invariants, same_as_engine
from nanoserve.labs.lab import Check, Context, Lab, expect, raises
from nanoserve.radix_cache import RadixCache

BS = TINY["block_size"]


class Setup:
    """The engine's pool, sequences and clock (here) and the student's KV manager (in the worker)."""

    def __init__(self, ctx: Context, num_blocks: int = 12, cache: bool = False) -> None:
        self.pool = BlockPool(num_blocks, BS)
        self.events: list = []
        self.clock = StepClock()
        self.clock.step = 4
        self.cache = RadixCache(self.pool, self.events.append, clock=self.clock) if cache else None
        self.kv = ctx.module.KVManager(self.pool, self.cache, None, self.events.append, clock=self.clock)
        self.moves = BlockMoves()                  # the plan's (the scheduler's, here): the runner reads it
        self.kv.begin_step(self.moves)

    def seq(self, seq_id: str, num_tokens: int, num_blocks: int, computed: int):
        """A running sequence of `num_tokens` prompt tokens holding `num_blocks` fresh blocks, `computed` of KV."""
        from nanoserve.sampling_params import SamplingParams
        from nanoserve.sequence import Sequence, SequenceStatus
        seq = Sequence(seq_id, None, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=4),
                       status=SequenceStatus.RUNNING)
        seq.block_table = self.pool.allocate(num_blocks)
        seq.num_computed_tokens = computed
        return seq

    def refs(self) -> list[int]:
        return [b.ref_count for b in self.pool.blocks]


SHARED_HINT = ('_shared_write_block: which block does the next token land in, and when would writing there '
               'disturb another holder? Think of a position at a block boundary, a full block that is shared, and'
               ' a position past the end of the table. It only looks: nothing changes')


def _why(computed: int, refs: list[int]) -> str:
    """Why the block written next needs a copy or not: the words of one case."""
    i, offset = divmod(computed, BS)
    if i >= len(refs):
        return f"position {computed} is in block {i}, past the table's {len(refs)} blocks"
    if offset == 0:
        return f"position {computed} opens block {i}: nothing is written there yet, a boundary"
    held = "held twice" if refs[i] > 1 else "held only by this table"
    return f"position {computed} is inside block {i}, partly filled and {held}"


def shared_write_block(ctx: Context) -> None:
    """Every position in and just past tables of 1 to 3 blocks, with each block (or none) shared: both sides
    of every block boundary, and the end of the table."""
    s = Setup(ctx)
    for num_blocks in (1, 2, 3):
        seq = s.seq(f"t{num_blocks}", BS * num_blocks + 2, num_blocks, 0)
        for computed in range(BS * num_blocks + 2):
            for shared in (None, *range(num_blocks)):
                refs = [2 if b == shared else 1 for b in range(num_blocks)]
                for b, r in zip(seq.block_table, refs):
                    s.pool.blocks[b].ref_count = r
                seq.num_computed_tokens = computed
                i = computed // BS
                want = i if computed % BS and i < num_blocks and refs[i] > 1 else None
                before = (list(seq.block_table), s.refs())
                got = s.kv._shared_write_block(seq)
                expect(got == want, f"_shared_write_block with {computed} tokens computed, a table of {num_blocks} "
                       f"blocks and ref counts {refs} returned {got}, expected {want} ({_why(computed, refs)})",
                       SHARED_HINT)
                expect((list(seq.block_table), s.refs()) == before,
                       "_shared_write_block changed the table or ref counts", "_shared_write_block only looks")
        for b in seq.block_table:                     # (back to one holder, for the next table's allocate)
            s.pool.blocks[b].ref_count = 1


COW_HINT = ('copy_on_write: afterwards the sequence holds a block of its own where it writes next, the other '
            'holders see no change, and the runner knows which KV to copy; with no block free for the copy, '
            'nothing may have changed. Check the order of your steps')


def copy_on_write(ctx: Context) -> None:
    s = Setup(ctx)
    seq = s.seq("a", 11, 3, 6)
    before = (list(seq.block_table), s.refs())
    expect(s.kv.copy_on_write(seq) is None and (list(seq.block_table), s.refs()) == before and
           list(s.moves.copies) == [] and not s.events,
           "copy_on_write of a sequence whose write block is not shared changed something or returned a value",
           COW_HINT)
    src = seq.block_table[1]
    s.pool.share([src])                               # a fork holds block 1 too
    table, refs = list(seq.block_table), s.refs()
    free_before = s.pool.free_queue.ids()
    got = s.kv.copy_on_write(seq)
    expect(isinstance(got, tuple) and len(got) == 2 and got[0] == src,
           f"copy_on_write of a shared partial block {src} returned {got}, expected ({src}, the new block)", COW_HINT)
    dst = got[1]
    expect(dst == free_before[0], f"the copy went to block {dst}, expected a fresh block from the pool "
           f"({free_before[0]}, the head of the free queue)", "take the copy with self._take(1) (the pool's allocate)")
    expect(list(seq.block_table) == [table[0], dst, table[2]],
           f"after copy_on_write the table is {list(seq.block_table)}, expected {[table[0], dst, table[2]]}",
           "only the block being written moves to its copy; the rest of the table stays")
    expect(s.pool.blocks[src].ref_count == refs[src] - 1 and s.pool.blocks[dst].ref_count == 1,
           f"after copy_on_write block {src} has ref count {s.pool.blocks[src].ref_count} (expected "
           f"{refs[src] - 1}) and the copy {dst} has {s.pool.blocks[dst].ref_count} (expected 1)",
           "the sequence that moved to its copy is no longer a holder of the shared block: free it once")
    expect([tuple(c) for c in s.moves.copies] == [(src, dst)], f"the step's copies for the runner are "
           f"{list(s.moves.copies)}, expected [({src}, {dst})]", "append (src, dst) to self.moves.copies: the runner "
           "copies the shared block's KV into the new one before the forward, or the copy holds garbage")
    cow = [e for e in s.events if isinstance(e, CowCopied)]
    expect(len(cow) == 1 and (cow[0].seq_id, cow[0].index, cow[0].src, cow[0].dst, cow[0].step) ==
           ("a", 1, src, dst, 4), f"copy_on_write emitted {s.events}, expected CowCopied(4, 'a', 1, {src}, {dst})",
           "emit CowCopied(step, seq_id, index, src, dst): the TUI and the traces show every copy")
    s.pool.check_invariants([seq.block_table, [src]])

    t = Setup(ctx, num_blocks=3)
    seq = t.seq("b", 10, 3, 6)
    t.pool.share([seq.block_table[1]])
    table, refs = list(seq.block_table), t.refs()
    raises(MemoryError, lambda: t.kv.copy_on_write(seq), "copy_on_write with no free block for the copy",
           "no block for the copy: MemoryError from the pool")
    expect((list(seq.block_table), t.refs(), list(t.moves.copies)) == (table, refs, []),
           f"a copy_on_write that found no free block changed the table to {list(seq.block_table)} and the ref "
           f"counts to {t.refs()}", "take the new block BEFORE letting go of the shared one: when there is no "
                                    "block, nothing may have changed")


FORK_HINT = ('fork: afterwards, what does the child share with its parent (the blocks and their holder counts, '
             'the KV computed, the cached prefix) and what does it own alone (its table)? Which event tells the '
             'TUI?')


def fork(ctx: Context) -> None:
    import torch
    s = Setup(ctx)
    parent = s.seq("p", 7, 2, 6)
    child = parent.fork("p.1", torch.Generator())
    refs = s.refs()
    s.kv.fork(parent, child, 42)
    expect(list(child.block_table) == list(parent.block_table),
           f"after fork the child's table is {list(child.block_table)}, the parent's {list(parent.block_table)}",
           "fork gives the child the parent's block ids (a copy of the list, not new blocks)")
    expect(child.block_table is not parent.block_table, "the child and the parent hold the same list object",
           "give the child its own list: list(parent.block_table); appending to one must not grow the other")
    want = [r + (1 if i in parent.block_table else 0) for i, r in enumerate(refs)]
    expect(s.refs() == want, f"after fork the ref counts are {s.refs()}, expected {want} (one more on each of the "
           f"parent's blocks {list(parent.block_table)})", "fork must share: one more holder (pool.share) on every "
                                                            "block of the parent")
    expect(child.num_computed_tokens == 6, f"the child has {child.num_computed_tokens} tokens computed, the parent 6",
           "the child's KV is the parent's: it starts with the parent's num_computed_tokens")
    forked = [e for e in s.events if isinstance(e, Forked)]
    expect(len(forked) == 1 and (forked[0].parent_id, forked[0].seq_id, tuple(forked[0].block_ids),
                                 forked[0].seed) == ("p", "p.1", tuple(parent.block_table), 42),
           f"fork emitted {s.events}, expected Forked(4, 'p', 'p.1', {tuple(parent.block_table)}, 42)",
           "emit Forked(step, parent id, child id, the child's blocks, seed)")

    c = Setup(ctx, cache=True)
    parent = c.seq("q", 9, 2, 8)
    node, _ = c.cache.insert("q", parent.all_token_ids, parent.block_table)
    c.cache.lock(node)
    parent.cache_node = node
    child = parent.fork("q.1", torch.Generator())
    c.events.clear()
    c.kv.fork(parent, child, 1)
    expect(child.cache_node is node and node.lock_count == 2,
           f"after fork of a sequence that holds radix node {node.node_id} locked, the child holds "
           f"{getattr(child.cache_node, 'node_id', None)} and the node's lock count is {node.lock_count}",
           "the child uses the parent's cached prefix too: lock it for the child (self._relock(child, node))")
    expect(any(isinstance(e, RadixLocked) for e in c.events), "fork of a sequence with a cached prefix emitted no "
           "RadixLocked", "lock with self._relock: it emits the event")


def _forked(ctx: Context, prompt_len: int):
    """An engine (student's KV manager) whose request "a" ran its prefill and was forked.

    Returns (engine, parent, child, the parent's ref counts just before the fork)."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(**{**TINY, "num_blocks": 16}), loaded=ctx.loaded(), components=ctx.components())
    engine.add_request("a", prompts(1, prompt_len, seed=9)[0], SamplingParams(max_tokens=6, temperature=0.9, seed=1))
    engine.step()                                    # the prefill: prompt_len tokens of KV, one sampled token
    reference_invariants(engine)
    parent = engine.sequences["a"]
    refs = [engine.pool.blocks[b].ref_count for b in parent.block_table]   # (the prefix cache holds full ones)
    child = engine.sequences[engine.fork("a")]
    return engine, parent, child, refs


def fork_shares(ctx: Context) -> None:
    engine, parent, child, before = _forked(ctx, 6)
    expect(child.block_table == parent.block_table,
           f"after fork the child's table is {child.block_table}, the parent's {parent.block_table}",
           "fork gives the child the parent's block ids (a copy of the list, not new blocks)")
    refs = [engine.pool.blocks[b].ref_count for b in parent.block_table]
    want = [r + 1 for r in before]
    expect(refs == want, f"after fork the parent's blocks have ref counts {refs}, expected {want} (one more each)",
           "fork must share: one more holder (pool.share) on every block of the parent")
    expect(child.block_table is not parent.block_table, "the child and the parent hold the same list object",
           "give the child its own list: list(parent.block_table); appending to one must not grow the other")
    reference_invariants(engine)


def cow_partial(ctx: Context) -> None:
    engine, parent, child, _ = _forked(ctx, 6)           # 6 tokens computed: block 1 holds 2 of 4 slots
    shared = parent.block_table[1]
    engine.step()                                     # both write position 6, inside block 1
    expect(parent.block_table[1] != child.block_table[1],
           f"after one step both sequences still use block {child.block_table[1]} for positions 4-7",
           "a CoW that forgets the partial last block: both sequences write their next token into the same "
           "slot. Before writing into a partly filled block that another table holds, take a copy")
    expect(parent.block_table[0] == child.block_table[0], "the full first block was copied too",
           "only the block being written is copied; full blocks stay shared")
    expect(engine.pool.blocks[shared].ref_count == 1,
           f"block {shared} has ref count {engine.pool.blocks[shared].ref_count} after the copy, expected 1",
           "the sequence that moved to its copy is no longer a holder of the shared block: free it once")
    copied = [c for c in engine.kv.moves.copies if c[0] == shared]
    expect(len(copied) == 1, f"the step's copies for the runner are {engine.kv.moves.copies}; expected one from block {shared}",
           "append (src, dst) to self.moves.copies: the runner copies the shared block's KV into the new one before "
           "the forward, or the copy holds garbage")
    reference_invariants(engine)


def cow_boundary(ctx: Context) -> None:
    engine, parent, child, _ = _forked(ctx, 8)           # 8 tokens: both blocks full, the next token opens block 2
    engine.step()
    expect(engine.kv.moves.copies == [], f"a fork at a block boundary copied {engine.kv.moves.copies}",
           "a full block is never written again: share it, never copy it; only a PARTLY filled block "
           "(num_computed_tokens % block_size != 0) needs a copy")
    expect(parent.block_table[:2] == child.block_table[:2] and parent.block_table[2] != child.block_table[2],
           f"tables after the step: parent {parent.block_table}, child {child.block_table}")
    reference_invariants(engine)


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    reqs = [("n3", prompts(1, 7, seed=2)[0], SamplingParams(max_tokens=9, temperature=1.0, n=3, seed=5)),
            ("f", prompts(1, 9, seed=4)[0], SamplingParams(max_tokens=10, temperature=0.7, seed=6)),
            ("g", prompts(1, 5, seed=8)[0], SamplingParams(max_tokens=8, temperature=0))]
    same_as_engine(ctx, reqs, {"num_blocks": 24}, fork_at={"f": 2, "g": 3},
                   hint="with your KV manager the forks' tokens differ from the engine's own: a fork reading "
                        "a block its sibling wrote into (a missed copy), or a copy that was never filled")


LAB = Lab(
    name="cow-fork",
    title="fork by sharing blocks; copy-on-write of the partly filled last block",
    module="nanoserve.kv_manager",
    blanks={
        "KVManager._shared_write_block": "i = the index of the block that holds position num_computed_tokens; "
                                         "return i only if that block is partly filled (not a boundary), exists "
                                         "in the table, and has ref_count > 1; else None",
        "KVManager.copy_on_write": "if _shared_write_block gives an index: take a fresh block (self._take(1)), "
                                   "drop this sequence's hold on the shared one (pool.free), put the new id in "
                                   "the table, append (src, dst) to self.moves.copies, emit CowCopied; return (src, dst)",
        "KVManager.fork": "share the parent's blocks (pool.share), give the child its own copy of the table and "
                          "the parent's num_computed_tokens, emit Forked, and lock the parent's cache node for "
                          "the child too (self._relock)",
    },
    contracts={
        "KVManager._shared_write_block": "The index of the block `seq` writes next (the one holding position "
                                         "num_computed_tokens) when it is partly filled, in the table, and held "
                                         "by another table too; else None. Changes nothing.",
        "KVManager.copy_on_write": "When `seq` is about to write into a shared block, it gets its own fresh copy "
                                   "in that table slot (the shared block keeps its other holders), the runner is "
                                   "asked to copy the KV (self.moves.copies), CowCopied is emitted; returns "
                                   "(src, dst). Otherwise None and nothing changes; no free block: MemoryError "
                                   "and nothing changes.",
        "KVManager.fork": "Afterwards `child` holds the same blocks as `parent` in a list of its own (one more "
                          "holder on each), the same number of computed tokens, and the parent's cached prefix "
                          "locked for it too; Forked is emitted.",
    },
    invariants="A block's ref_count is the number of tables (and the radix tree) holding it. A full block is "
               "never written again; the block a sequence writes next is held by that sequence alone before "
               "the forward (copy-on-write). self.moves lists this step's KV copies for the runner.",
    components=lambda m: Components(kv_manager=m.KVManager),
    checks=(
        SIGNATURES,
        Check("KVManager._shared_write_block: a shared, partly filled block", shared_write_block, SHARED_HINT, 30,
              function="KVManager._shared_write_block"),
        Check("KVManager.copy_on_write: a fresh copy, the shared one kept", copy_on_write, COW_HINT, 30,
              function="KVManager.copy_on_write"),
        Check("KVManager.fork: shares every block, its own table", fork, FORK_HINT, 30, function="KVManager.fork"),
        Check("real engine: a fork shares every block", fork_shares,
              "fork: the child shares its parent's blocks (the same ids, one more holder each) in a list of its own", 60),
        Check("real engine: first write into a shared partial block copies it", cow_partial,
              "copy_on_write (and _shared_write_block, which finds the block): the partly filled block both share must "
              "be copied before either sequence writes into it", 60),
        Check("real engine: a fork at a block boundary copies nothing", cow_boundary,
              "_shared_write_block: a block that is full is never written again; which block does the next token open?", 60),
        Check("real engine: n > 1 and forks, same tokens", engine_runs,
              "copy_on_write or _shared_write_block: a fork read a block its sibling wrote (a missed copy), or a copy the "
              "runner never filled; watch CowCopied in `nanoserve tui --lab cow-fork=FILE`", 240),
    ),
    why=(
        ("Why is only the partly filled last block ever copied, never a full one?",
         "KV at a position never changes once written, and a full block has no free slot: neither sequence "
         "ever writes into it again, so sharing it is free for as long as both live. Only the block with free "
         "slots is written next, by both."),
        ("Why does the copy happen in the scheduler's plan, before the forward, and not when the fork is made?",
         "Most forks never diverge inside the shared block before one of them finishes or is preempted, or "
         "they diverge at a boundary: copying at fork time would pay for copies nobody needs. Deciding at the "
         "first write, and letting the runner copy the KV just before the forward that writes, copies exactly "
         "once, exactly when needed."),
        ("Why must copy_on_write take the new block before it lets go of the shared one?",
         "Taking can fail (MemoryError, or an eviction). Had the shared block already lost this holder, the "
         "sequence would keep a block in its table that no longer counts it: freed too early, handed out, "
         "overwritten."),
    ),
    prerequisites="the block-pool lab; lesson 5 (fork and copy-on-write)",
    minutes=40,
)
