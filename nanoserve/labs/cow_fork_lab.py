"""Lab cow-fork: forking a sequence by sharing its blocks, and copy-on-write (nanoserve/kv_manager.py).

The student writes `KVManager.fork`, `_shared_write_block` and
`copy_on_write`. A fork shares every block of its parent (ref count + 1,
nothing copied). Full blocks are never written again, so sharing them is
free forever; the partly filled last block is written by both, so the first
one to write gets its own copy (and the runner copies the KV into it before
the forward). The checks fork real requests in the real engine, at a
partial block and at a block boundary, and look at the tables, ref counts,
the copies handed to the runner, and the tokens.
"""

from __future__ import annotations

from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import TINY, prompts, reference_invariants, same_as_engine
from nanoserve.labs.lab import Check, Context, Lab, expect

BS = TINY["block_size"]


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
    components=lambda m: Components(kv_manager=m.KVManager),
    checks=(
        SIGNATURES,
        Check("fork shares every block", fork_shares,
              "fork shares the parent's blocks: same ids, ref count + 1, its own list", 60),
        Check("first write into a shared partial block copies it", cow_partial,
              "copy-on-write the partly filled last block before either sequence writes into it", 60),
        Check("fork at a block boundary copies nothing", cow_boundary,
              "only a partly filled block needs a copy", 60),
        Check("real engine: n > 1 and forks, same tokens", engine_runs,
              "run the engine with your KV manager; fork a request after a few steps and watch CowCopied", 240),
    ),
    prerequisites="the block-pool lab; lesson 5 (fork and copy-on-write)",
    minutes=40,
)
