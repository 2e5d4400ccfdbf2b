"""The block pool: who owns each physical KV block, and which blocks are free.

The KV cache is cut into `num_blocks` fixed-size blocks of `block_size` token
slots each (the tensors live in `runner.py`; this module only does the
bookkeeping). A sequence holds a *block table*: a list of physical block ids,
one per `block_size` tokens of its context, so token i lives in block
`table[i // block_size]` at offset `i % block_size`.

Every block is either

* in use: `ref_count > 0`, held by that many block tables, or
* free: `ref_count == 0`, sitting in the free queue.

The free queue is a doubly linked list in LRU order, like vLLM's
`FreeKVCacheBlockQueue`: allocation pops from the head, freeing appends to
the tail, and any block can be unlinked in O(1). A request frees its blocks
in reverse order, as vLLM does. There the order matters: vLLM's prefix cache
finds freed blocks by hash and revives them from the queue, so a request's
tail should be reused before its prefix. In nanoserve no freed block is
revived: the radix tree holds its own reference on every block it caches
(`radix_cache.py`), so the order only decides which free block is handed out
next.

This module knows nothing about sequences, scheduling or tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from nanoserve.display import Displayable


class Block:
    """One physical KV block: its id, its ref count, and its free-queue links."""

    __slots__ = ("block_id", "ref_count", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.prev: Block | None = None  # free-queue neighbours; None while in use
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove.

    Two sentinel nodes (`head`, `tail`) mean no operation needs a special
    case for an empty list or for the first and last element.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        """Put `block` at the tail: it will be reused last."""
        last = self.tail.prev
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.size += 1

    def popleft(self) -> Block:
        """Take the block at the head: the one freed longest ago."""
        if self.size == 0:
            raise IndexError("no free blocks")
        block = self.head.next
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink `block` from wherever it sits in the queue."""
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def __iter__(self):
        node = self.head.next
        for _ in range(self.size):   # bounded: a corrupted (cyclic) list cannot hang us
            if node is self.tail:
                return
            yield node
            node = node.next

    def ids(self) -> list[int]:
        """Block ids from head (next to be allocated) to tail."""
        return [b.block_id for b in self]


class BlockPool(Displayable):
    """Allocates, shares and frees physical blocks; checks its own bookkeeping."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    # -- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        """How many more blocks a table of `num_held` blocks needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    # -- allocate / share / free ------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue (all or nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block = self.free_queue.popleft()
            block.ref_count = 1
            ids.append(block.block_id)
        return ids

    def append_slots(self, table: list[int], num_tokens: int) -> list[int]:
        """Grow `table` in place so it covers `num_tokens` tokens; return the new block ids."""
        new_ids = self.allocate(self.blocks_needed(len(table), num_tokens))
        table.extend(new_ids)
        return new_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (a fork or a cache lock)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self.blocks[block_id].ref_count == 0:
                raise ValueError(f"cannot share free block {block_id}")
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool [0, {self.num_blocks})")

    def free(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one holder from each block, last block first.

        Returns the ids whose ref count reached zero, in the order they were
        appended to the free queue.
        """
        # Check everything first, so a bad call changes nothing.
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if self.blocks[block_id].ref_count < times:
                raise ValueError(f"double free of block {block_id}")
        released = []
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
                released.append(block_id)
        return released

    # -- invariants -------------------------------------------------------------

    def check_invariants(self, tables: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError if the pool disagrees with the block tables holding it.

        `tables` are all block tables (and any other holders) in the engine.
        Each table's length against its token count is the scheduler's check.
        """
        holders = Counter(block_id for table in tables for block_id in table)
        strays = [b for b in holders if not 0 <= b < self.num_blocks]
        assert not strays, f"block tables hold ids outside the pool: {strays}"
        free_ids = self.free_queue.ids()
        assert len(free_ids) == len(set(free_ids)) == len(self.free_queue), "free queue has duplicates or a bad size"
        node = self.free_queue.head   # the backward links must mirror the forward ones
        for block_id in free_ids + [None]:
            nxt = node.next
            assert nxt.prev is node, f"free queue: broken prev link after block {node.block_id}"
            node = nxt
        assert node is self.free_queue.tail, "free queue does not end at its tail"
        free_set = set(free_ids)
        for block in self.blocks:
            held = holders.get(block.block_id, 0)
            assert block.ref_count == held, f"block {block.block_id}: ref_count {block.ref_count} != {held} holders"
            assert (block.ref_count == 0) == (block.block_id in free_set), (
                f"block {block.block_id}: ref_count {block.ref_count} but in free queue = {block.block_id in free_set}"
            )
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + len(free_set) == self.num_blocks, "free + used != num_blocks"

    def snapshot(self) -> dict:
        """Plain-data view: ref counts per block and the free queue in LRU order."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "ref_counts": [b.ref_count for b in self.blocks],
            "free_queue": self.free_queue.ids(),
        }
