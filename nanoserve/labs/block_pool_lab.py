"""Lab block-pool: allocate, share and free physical KV blocks, with an LRU free queue.

The student rewrites the bodies of `FreeBlockQueue.append/remove/popleft`
and `BlockPool.allocate/free/share` (nanoserve/block_pool.py). The checks
run in that order, each on one function and on values the student's own code
returned (never on the ids a fresh pool would give), so the first failing
row names the function at fault: a queue bug is the queue's, not its
callers'. Every rule the TODOs and docstrings state is checked: the queue's
links in both directions, IndexError on an empty queue, ValueError for an id
outside the pool or a free block, MemoryError before anything changes, the
free order. Then the real engine runs on the pool: preemption, a prefix cache
and forked completions all lean on ref counts.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool as RealPool
from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, same_as_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect, raises

N = 6       # blocks in the checks' pools


def walk(queue, who: str, limit: int = 64) -> list[int]:
    """The queue's block ids, head to tail, following `next` and checking each `prev` on the way."""
    hint = (f"{who} must leave a well-linked list: for every neighbour pair a, b: a.next is b and b.prev is a, "
            "from the head sentinel to the tail sentinel")
    ids, node = [], queue.head
    for _ in range(limit):
        after = node.next
        label = "the head sentinel" if node is queue.head else f"block {node.block_id}"
        if after is None:
            raise CheckFailed(f"after {who}, the queue breaks at {label}: its next is None", hint)
        if after.prev is not node:
            raise CheckFailed(f"after {who}, the queue's links disagree: {label}.next is "
                              f"{_label(queue, after)}, but that one's prev is not {label}", hint)
        if after is queue.tail:
            return ids
        ids.append(after.block_id)
        node = after
    raise CheckFailed(f"after {who}, the queue does not reach its tail sentinel (a cycle?)", hint)


def _label(queue, node) -> str:
    return "the tail sentinel" if node is queue.tail else f"block {node.block_id}"


def _queue_is(queue, want: list[int], who: str, hint: str) -> None:
    got = walk(queue, who)
    expect(got == want, f"after {who} the queue is {got}, expected {want}", hint)
    expect(len(queue) == len(want), f"after {who} len(queue) is {len(queue)}, but {len(want)} blocks are linked in",
           f"{who} must keep `size` equal to the number of linked blocks")


def _unlinked(block, who: str) -> None:
    expect(block.prev is None and block.next is None,
           f"after {who}, block {block.block_id} still points into the queue (prev/next should be None)",
           "clear the links of a block that leaves the queue: a stale link lets a later remove() corrupt the list")


def _queue(ctx: Context, ids: list[int]):
    """A FreeBlockQueue (the student's) of fresh blocks with these ids, built by append."""
    q = ctx.module.FreeBlockQueue([])
    blocks = [ctx.module.Block(i) for i in ids]
    for b in blocks:
        q.append(b)
    return q, blocks


APPEND_HINT = ('append: where in the queue does a freed block go, so that the blocks freed longest ago are reused'
               ' first? Check the links on both sides of where it lands')


def queue_append(ctx: Context) -> None:
    q = ctx.module.FreeBlockQueue([])
    _queue_is(q, [], "FreeBlockQueue([])", "a new empty queue is the two sentinels linked to each other")
    want = []
    for block_id in (5, 2, 7, 0):
        q.append(ctx.module.Block(block_id))
        want.append(block_id)
        _queue_is(q, want, f"append(block {block_id})", APPEND_HINT)


def queue_popleft(ctx: Context) -> None:
    q, blocks = _queue(ctx, [4, 1, 3])
    for k, block in enumerate(blocks):
        got = q.popleft()
        expect(got is block, f"popleft() #{k + 1} on the queue [4, 1, 3] returned "
               f"{'block ' + str(got.block_id) if got is not None else None}, expected block {block.block_id}",
               "popleft takes the block right after the head sentinel: the one appended longest ago")
        _queue_is(q, [b.block_id for b in blocks[k + 1:]], f"popleft() #{k + 1}",
                  "unlink the popped block: the head sentinel and the next block point at each other")
        _unlinked(got, "popleft()")
    raises(IndexError, q.popleft, "popleft() on an empty queue",
           "popleft on an empty queue raises IndexError (the TODO's rule): without the check it pops the tail "
           "sentinel and corrupts the list")
    _queue_is(q, [], "a refused popleft() on an empty queue", "a refused popleft changes nothing")
    q.append(blocks[0])
    _queue_is(q, [4], "append after the queue was emptied", "popleft must leave the sentinels intact")


def queue_remove(ctx: Context) -> None:
    q, blocks = _queue(ctx, [0, 1, 2, 3, 4])
    for block, left in ((blocks[2], [0, 1, 3, 4]), (blocks[0], [1, 3, 4]), (blocks[4], [1, 3]),
                        (blocks[3], [1]), (blocks[1], [])):
        q.remove(block)
        who = f"remove(block {block.block_id})"
        _queue_is(q, left, who, "remove links the block's two neighbours to each other (first, middle or last "
                                "block alike: the sentinels make them the same case) and shrinks the size")
        _unlinked(block, who)


def _state(pool) -> tuple[list[int], list[int]]:
    return walk(pool.free_queue, "the pool's call"), [b.ref_count for b in pool.blocks]


def _unchanged(pool, before, what: str, hint: str) -> None:
    after = _state(pool)
    expect(after == before, f"{what} changed the pool: free queue {before[0]} -> {after[0]}, ref counts "
           f"{before[1]} -> {after[1]}", hint)


ALL_OR_NOTHING = "check the whole call first, then change anything: a refused call leaves the pool as it was"


def allocate(ctx: Context) -> None:
    pool = ctx.module.BlockPool(N, 4)
    order, refs = _state(pool)
    expect(sorted(order) == list(range(N)) and refs == [0] * N,
           f"a new pool's free queue is {order} with ref counts {refs}", "keep the starter's __init__")
    got = pool.allocate(2)
    expect(isinstance(got, list) and got == order[:2], f"allocate(2) on the free queue {order} returned {got}, "
           f"expected {order[:2]}", "allocate pops from the HEAD of the free queue (the block freed longest ago)")
    _queue_is(pool.free_queue, order[2:], "allocate(2)", "allocated blocks leave the free queue")
    refs = [b.ref_count for b in pool.blocks]
    expect(all(refs[i] == (1 if i in got else 0) for i in range(N)),
           f"after allocate(2) -> {got} the ref counts are {refs}", "every allocated block starts with ref_count 1")
    before = _state(pool)
    expect(pool.allocate(0) == [], "allocate(0) did not return []", "allocate(0) takes nothing")
    _unchanged(pool, before, "allocate(0)", "allocate(0) takes nothing")
    raises(ValueError, lambda: pool.allocate(-1), "allocate(-1)", "a negative count is a ValueError")
    _unchanged(pool, before, "a refused allocate(-1)", ALL_OR_NOTHING)
    raises(MemoryError, lambda: pool.allocate(N - 1), f"allocate({N - 1}) with {N - 2} free blocks",
           "too few free blocks: MemoryError")
    _unchanged(pool, before, f"a refused allocate({N - 1})",
               "allocate is all or nothing: check there are enough free blocks BEFORE taking any")
    rest = pool.allocate(N - 2)
    expect(rest == order[2:], f"allocate({N - 2}) of the last {N - 2} free blocks returned {rest}, expected "
           f"{order[2:]}", "taking exactly what is free is allowed")
    raises(MemoryError, lambda: pool.allocate(1), "allocate(1) on an empty free queue",
           "no free block: MemoryError")


FREE_HINT = ("free: in which order are a table's blocks handed back, and why does that order matter to the prefix"
             " cache (a sequence's last blocks are the least likely to be shared again)? Only a block nobody "
             'holds any more goes back to the queue; check what you return')


def free(ctx: Context) -> None:
    pool = ctx.module.BlockPool(N, 4)
    order, _ = _state(pool)
    table = pool.allocate(4)
    released = pool.free(table[:2])
    want = [table[1], table[0]]
    expect(released == want, f"free({table[:2]}) returned {released}, expected {want}", FREE_HINT)
    _queue_is(pool.free_queue, order[4:] + want, f"free({table[:2]})", FREE_HINT)
    expect([pool.blocks[b].ref_count for b in table] == [0, 0, 1, 1],
           f"after free({table[:2]}) the ref counts of {table} are {[pool.blocks[b].ref_count for b in table]}",
           FREE_HINT)
    before = _state(pool)
    expect(pool.free([]) == [], "free([]) did not return []", FREE_HINT)
    _unchanged(pool, before, "free([])", FREE_HINT)
    for ids, why in (([table[0]], "a block that is already free (a double free)"),
                     ([table[2], table[2]], "a block held once, twice in one call"),
                     ([table[2], table[0]], "a held block, then a free one"),
                     ([-1], "id -1 (Python would index the last block)"),
                     ([N], f"id {N}, outside the pool of {N}")):
        raises(ValueError, lambda ids=ids: pool.free(ids), f"free({ids}): {why},",
               "every id must be inside the pool [0, num_blocks) and held at least as often as it appears: "
               "else ValueError")
        _unchanged(pool, before, f"a refused free({ids})", ALL_OR_NOTHING)
    shared = table[3]
    pool.blocks[shared].ref_count = 2          # a second holder, as share() would add
    expect(pool.free([shared]) == [], f"free([{shared}]) of a block with 2 holders released it",
           "a block stays in use until its ref count reaches 0: another table still holds it")
    expect(pool.blocks[shared].ref_count == 1 and shared not in walk(pool.free_queue, "free"),
           f"free([{shared}]) of a block with 2 holders: ref count {pool.blocks[shared].ref_count}, expected 1, "
           "and not in the free queue", FREE_HINT)
    expect(pool.free([shared]) == [shared], f"the last holder's free([{shared}]) did not release it", FREE_HINT)


def share(ctx: Context) -> None:
    pool = ctx.module.BlockPool(N, 4)
    held = pool.allocate(2)
    free_id = walk(pool.free_queue, "allocate")[0]
    before = _state(pool)
    expect(pool.share(held) is None, f"share({held}) returned something", "share returns nothing")
    refs = [pool.blocks[b].ref_count for b in held]
    expect(refs == [2, 2], f"after share({held}) their ref counts are {refs}, expected [2, 2]",
           "share adds one holder to each block")
    expect(walk(pool.free_queue, "share") == before[0], f"share({held}) changed the free queue",
           "share only counts holders; held blocks are not in the queue")
    before = _state(pool)
    for ids, why in (([free_id], "a free block"), ([-1], "id -1 (Python would index the last block)"),
                     ([N], f"id {N}, outside the pool of {N}"), ([held[0], free_id], "a held block, then a free one")):
        raises(ValueError, lambda ids=ids: pool.share(ids), f"share({ids}): {why},",
               "check every id first: inside the pool [0, num_blocks) and not free, else ValueError; then add 1 "
               "to each ref count (a refused share changes nothing)")
        _unchanged(pool, before, f"a refused share({ids})", ALL_OR_NOTHING)
    pool.share([])
    _unchanged(pool, before, "share([])", "share([]) changes nothing")
    pool.share(OneShot(held))
    refs = [pool.blocks[b].ref_count for b in held]
    expect(refs == [3, 3], f"share(iterator over {held}) left their ref counts at {refs}, expected [3, 3]",
           "share takes any iterable of ids (its signature: Iterable[int]): an iterator can be walked only "
           "once, so make a list of it before checking the ids and again adding the holders")
    try:
        RealPool.check_invariants(pool, [held, held, held])
    except AssertionError as exc:
        raise CheckFailed(f"after share the pool's own invariants break: {exc}", "share adds one holder per id")


class OneShot:
    """An iterable that can be walked only once (an iterator handed to share)."""

    def __init__(self, items) -> None:
        self.items = list(items)

    def __iter__(self):
        items, self.items = self.items, []
        return iter(items)


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=10, temperature=0)
    reqs = [(f"g{i}", p, greedy) for i, p in enumerate(prompts(4, 11, shared=8))]
    reqs.append(("n2", prompts(1, 7, seed=5)[0], SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=7)))
    same_as_engine(ctx, reqs, {"num_blocks": 14},
                   "the engine ran, but its tokens differ: a block handed to two requests at once (freed "
                   "while still held, or allocated twice) lets one request overwrite the other's KV")


INVARIANTS = """Between calls, every block is in exactly one of two states:

    free:   ref_count == 0 and linked into the free queue (once)
    in use: ref_count == the number of tables (and the radix tree) holding it, not in the queue

The free queue is a doubly linked list between two sentinels (head, tail): for
neighbours a, b: a.next is b and b.prev is a; a block outside the queue has
prev = next = None; len(queue) is the number of blocks linked in. A call that
raises changes nothing."""

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
    contracts={
        "FreeBlockQueue.append": "`block` becomes the last block of the queue, in O(1); len grows by one.",
        "FreeBlockQueue.popleft": "Removes and returns the first block, in O(1), its links cleared. On an empty "
                                  "queue: IndexError, and the queue is unchanged.",
        "FreeBlockQueue.remove": "Unlinks `block` (which is in the queue) wherever it sits, in O(1); its links "
                                 "are cleared; len shrinks by one.",
        "BlockPool.allocate": "Returns n block ids taken from the head of the free queue, in queue order, each "
                              "now held once. n < 0: ValueError; fewer than n free: MemoryError; either way "
                              "nothing changes.",
        "BlockPool.share": "One more holder for each id. An id outside [0, num_blocks) or of a free block: "
                           "ValueError, and nothing changes.",
        "BlockPool.free": "One holder fewer for each id, the ids taken from the last to the first; a block "
                          "left with no holder joins the tail of the free queue. Returns those blocks in the "
                          "order they joined. An id outside the pool, or freed more often than it is held: "
                          "ValueError, and nothing changes.",
    },
    invariants=INVARIANTS,
    components=lambda m: Components(block_pool=m.BlockPool),
    checks=(
        SIGNATURES,
        Check("FreeBlockQueue.append: at the tail, both links", queue_append, APPEND_HINT, 30,
              function="FreeBlockQueue.append"),
        Check("FreeBlockQueue.remove: first, middle, last", queue_remove,
              "remove links the block's neighbours to each other, clears its links, shrinks the size", 30,
              function="FreeBlockQueue.remove"),
        Check("FreeBlockQueue.popleft: the head; IndexError when empty", queue_popleft,
              "popleft unlinks and returns the block after the head sentinel; on an empty queue it raises "
              "IndexError and changes nothing", 30, function="FreeBlockQueue.popleft"),
        Check("BlockPool.allocate: from the head, all or nothing", allocate,
              "allocate pops from the head; ValueError below 0; MemoryError before changing anything", 30,
              function="BlockPool.allocate"),
        Check("BlockPool.free: last block first, to the tail; bad ids refused", free, FREE_HINT, 30,
              function="BlockPool.free"),
        Check("BlockPool.share: one more holder; bad ids refused", share,
              "share checks every id (inside the pool, not free) before adding one holder to each", 30,
              function="BlockPool.share"),
        Check("real engine: same tokens, invariants every step", engine_runs,
              "free (the order blocks come back) and allocate (which blocks go out) pass their own rows yet meet here in the "
              "engine's order of calls: run the engine with your pool in a REPL, engine.check_invariants() after each step", 240),
    ),
    why=(
        ("Why is the free queue a queue (allocate from the head, free to the tail) and not a stack?",
         "The block freed longest ago is handed out first. Engines whose prefix cache finds freed blocks by "
         "hash (vLLM) can revive a block while it still sits in the queue, so the most recently freed KV "
         "should survive the longest. In nanoserve the radix tree holds its own reference instead, and the "
         "order only decides which free block is reused next: predictably, which the TUI and the tests rely on."),
        ("Why does free walk a table from its last block to its first?",
         "A request's tail is the part nobody else shares, its prefix the part most likely to be asked for "
         "again (a system prompt). Freed last-first, the tail joins the queue first and is reused first; the "
         "prefix stays in the queue, revivable, the longest."),
        ("Why must allocate, share and free check the whole call before changing anything?",
         "Their callers cannot undo half a call. A free that dropped two of three holders and then raised "
         "leaves ref counts that no longer match the block tables: a block freed while a table still points "
         "at it is handed to another request, and two requests overwrite each other's KV, silently."),
    ),
    prerequisites="Python; lesson 1 (the block pool)",
    minutes=40,
)
