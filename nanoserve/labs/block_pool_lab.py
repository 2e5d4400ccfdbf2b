"""Lab block-pool: allocate, share and free physical KV blocks, with an LRU free queue.

The student rewrites the bodies of `FreeBlockQueue.append/popleft/remove`
and `BlockPool.allocate/share/free` (nanoserve/block_pool.py). The checks
poke the pool directly (order of the free queue, all-or-nothing allocation,
refused double frees) and then run the real engine on it: preemption, a
prefix cache and forked completions all lean on ref counts.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool as RealPool
from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, same_as_engine
from nanoserve.labs.lab import Check, Context, Lab, expect


def _pool(ctx: Context, n: int = 6, bs: int = 4):
    return ctx.module.BlockPool(n, bs)


def _check(pool, tables) -> None:
    RealPool.check_invariants(pool, tables)   # the engine's own check, on the student's pool


def allocate_order(ctx: Context) -> None:
    pool = _pool(ctx)
    a = pool.allocate(2)
    expect(a == [0, 1], f"allocate(2) on a fresh pool gave {a}, expected [0, 1] (the head of the free queue)",
           "allocate must pop from the HEAD of the free queue (the block freed longest ago), not the tail")
    expect(pool.free_queue.ids() == [2, 3, 4, 5], f"free queue after allocate(2) is {pool.free_queue.ids()}")
    _check(pool, [a])
    before = pool.free_queue.ids()
    try:
        pool.allocate(5)
    except MemoryError:
        pass
    else:
        raise AssertionError("allocate(5) with 4 free blocks did not raise MemoryError")
    expect(pool.free_queue.ids() == before,
           f"a failed allocate(5) changed the free queue from {before} to {pool.free_queue.ids()}",
           "allocate is all or nothing: check there are enough free blocks BEFORE taking any")
    _check(pool, [a])
    expect(pool.allocate(0) == [], "allocate(0) should return []")


def free_order(ctx: Context) -> None:
    pool = _pool(ctx)
    table = pool.allocate(4)
    released = pool.free(table[:2])
    expect(released == [1, 0], f"free([0, 1]) returned {released}, expected [1, 0] (last block first)",
           "free walks the table from its LAST block to its first, and returns the blocks that hit ref 0")
    expect(pool.free_queue.ids() == [4, 5, 1, 0], f"free queue is {pool.free_queue.ids()}, expected [4, 5, 1, 0]",
           "a freed block joins the TAIL of the free queue, so it is reused last (LRU)")
    _check(pool, [table[2:]])
    try:
        pool.free([0])
    except ValueError:
        pass
    else:
        raise AssertionError("free([0]) of a free block did not raise ValueError (a double free)")
    _check(pool, [table[2:]])
    try:
        pool.free([2, 2])
    except ValueError:
        pass
    else:
        raise AssertionError("free([2, 2]) of a block held once did not raise ValueError")
    expect(pool.blocks[2].ref_count == 1, "a refused free([2, 2]) changed block 2's ref count",
           "check the whole call first (count each id), then change anything: a bad free changes nothing")
    _check(pool, [table[2:]])


def shared_blocks(ctx: Context) -> None:
    pool = _pool(ctx)
    a = pool.allocate(2)
    pool.share(a)                                  # a fork: two tables hold both blocks
    expect([pool.blocks[i].ref_count for i in a] == [2, 2], "share() did not raise the ref counts to 2")
    _check(pool, [a, a])
    released = pool.free(a)                        # one holder goes
    expect(released == [] and pool.num_free_blocks == 4,
           f"freeing one of two holders released {released}",
           "a block shared by two tables must stay in use until BOTH free it: a duplicate block freed "
           "while a table still points at it is how two requests end up overwriting each other's KV")
    _check(pool, [a])
    try:
        pool.share([5])
    except ValueError:
        pass
    else:
        raise AssertionError("share([5]) of a free block did not raise ValueError")
    _check(pool, [a])


def queue_links(ctx: Context) -> None:
    pool = _pool(ctx)
    q = pool.free_queue
    middle = pool.blocks[3]
    q.remove(middle)
    expect(q.ids() == [0, 1, 2, 4, 5] and len(q) == 5, f"after remove(block 3) the queue is {q.ids()} "
           f"(size {len(q)})", "remove must link block 3's neighbours to each other and shrink the size")
    q.append(middle)
    expect(q.ids() == [0, 1, 2, 4, 5, 3], f"after append(block 3) the queue is {q.ids()}")
    first = q.popleft()
    expect(first.block_id == 0 and q.ids() == [1, 2, 4, 5, 3], "popleft did not take block 0 from the head")
    expect(first.prev is None and first.next is None,
           "a popped block still points into the queue (prev/next should be None)")
    node = q.tail
    back = []
    while node.prev is not None and node.prev is not q.head and len(back) < 10:
        node = node.prev
        back.append(node.block_id)
    expect(back[::-1] == q.ids(), f"walking the queue backwards gives {back[::-1]}, forwards {q.ids()}",
           "update BOTH links (prev and next) on every append and remove")


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=10, temperature=0)
    reqs = [(f"g{i}", p, greedy) for i, p in enumerate(prompts(4, 11, shared=8))]
    reqs.append(("n2", prompts(1, 7, seed=5)[0], SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=7)))
    same_as_engine(ctx, reqs, {"num_blocks": 14},
                   "the engine ran, but its tokens differ: a block handed to two requests at once (freed "
                   "while still held, or allocated twice) lets one request overwrite the other's KV")


LAB = Lab(
    name="block-pool",
    title="allocate, share and free KV blocks; the LRU free queue",
    module="nanoserve.block_pool",
    blanks={
        "FreeBlockQueue.append": "link `block` in just before the tail sentinel; grow the size",
        "FreeBlockQueue.popleft": "IndexError when empty; else unlink and return the block after the head",
        "FreeBlockQueue.remove": "link the block's neighbours to each other, clear its links, shrink the size",
        "BlockPool.allocate": "check n (ValueError below 0, MemoryError if too few free), then pop n blocks "
                              "from the head and give each ref_count 1",
        "BlockPool.share": "check every id first (inside the pool, not free), then add 1 to each ref count",
        "BlockPool.free": "check the whole call first (a double free changes nothing), then walk the ids last "
                          "to first: ref_count - 1, and at 0 append the block to the free queue",
    },
    components=lambda m: Components(block_pool=m.BlockPool),
    checks=(
        SIGNATURES,
        Check("allocate: head of the queue, all or nothing", allocate_order,
              "allocate pops from the head; when there are too few free blocks raise MemoryError before "
              "changing anything", 30),
        Check("free: last block first, to the tail", free_order,
              "free appends blocks whose ref count reaches 0 to the tail, last block of the table first; "
              "a double free raises ValueError and changes nothing", 30),
        Check("shared blocks stay until the last holder frees", shared_blocks,
              "share adds a holder; free removes one; only at ref count 0 is a block free", 30),
        Check("free queue links (remove from the middle)", queue_links,
              "a doubly linked list: every append/remove/popleft updates prev and next on both sides", 30),
        Check("real engine: same tokens, invariants every step", engine_runs,
              "run the engine with your pool in a REPL and call engine.check_invariants() after each step", 240),
    ),
    prerequisites="Python; lesson 1 (the block pool)",
    minutes=40,
)
