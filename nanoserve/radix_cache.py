"""The radix prefix cache: KV blocks that finished requests (and running ones) leave behind for others.

Many requests start with the same tokens: a system prompt, a few-shot
preamble, the conversation so far. Their KV is identical, because the K and V
at position i depend only on tokens 0..i. The cache keeps those blocks in a
*radix tree* (SGLang's RadixAttention, arXiv:2312.07104):

    root ─┬─ [You are a helpful | assistant. Answer ]   blocks (3, 7)
          │      ├─ [What is 2+2?]                      block  (9)
          │      └─ [Name a colour]                     block  (12)
          └─ [The quick brown fox]                      block  (4)

* An edge is a span of tokens in **whole blocks**, and each node holds the
  physical block ids of its span. A node's children are keyed by the tokens
  of their first block, so two children never start with the same block.
* `match_prefix(tokens)` walks down as far as the tokens agree and returns
  the blocks on the way: the sequence shares them (ref count + 1) and starts
  with `num_computed_tokens` at the match, so their prefill really is
  skipped. The match is capped to leave at least one token to compute: the
  step needs a query to produce the next token's logits. A match that ends
  inside a node's span *splits* the node at that block boundary.
* `insert(seq_id, tokens, block_ids)` adds a sequence's blocks as soon as they
  fill (the engine calls it every step), so requests arriving while the
  first one still runs already share its prefix. Where the tree already
  holds the same tokens in other blocks (two sequences computed the same
  prefix at once), `insert` reports the duplicates and the caller swaps its
  copy for the cached block.
* The tree holds **one reference** on each of its blocks. A node is *locked*
  while a running sequence uses it: `lock(node)` counts one more user on the
  node and on every ancestor. An unlocked node's blocks are held by the tree
  alone: they are *cached and evictable*.
* When the pool runs short, `evict(n)` frees unlocked leaves, least recently
  used first (`last_access` is the step of the last match or insert through
  the node). Evicting a leaf may make its parent an unlocked leaf, which is
  then a candidate too.

vLLM and nano-vllm find cached blocks differently: each full block gets a
hash of its tokens *and of its prefix's hash*, and a dict maps hashes to
blocks. Both find the same blocks; the tree shows the sharing structure
directly, which is what nanoserve wants to draw (lesson 4 compares them).

The cache changes ref counts through the block pool; it knows nothing of
sequences or the scheduler. `emit` publishes its events.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
from nanoserve.display import Displayable


class RadixNode:
    """A span of whole blocks: its tokens, its physical blocks, who uses it and when."""

    __slots__ = ("node_id", "parent", "tokens", "block_ids", "children", "lock_count", "last_access")

    def __init__(self, node_id: int, parent: RadixNode | None, tokens: tuple[int, ...], block_ids: list[int],
                 last_access: int = 0) -> None:
        self.node_id = node_id
        self.parent = parent
        self.tokens = tokens                 # len(tokens) == len(block_ids) * block_size
        self.block_ids = block_ids
        self.children: dict[tuple[int, ...], RadixNode] = {}   # keyed by the child's first block of tokens
        self.lock_count = 0                  # running sequences that use this node (or a node below it)
        self.last_access = last_access       # step of the last match or insert through this node

    def path(self) -> list[RadixNode]:
        """This node and its ancestors up to (not including) the root, deepest first."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes

    def __repr__(self) -> str:
        return f"RadixNode({self.node_id}, blocks={self.block_ids}, lock={self.lock_count})"


class RadixCache(Displayable):
    def __init__(self, pool: BlockPool, emit: Callable[[ev.Event], None],
                 span_text: Callable[[list[int]], str] | None = None, clock: ev.StepClock | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.emit = emit
        self.span_text = span_text or (lambda tokens: " ".join(map(str, tokens)))   # a node's tokens as text
        self.root = RadixNode(0, None, (), [])
        self.root.lock_count = 1             # the root is never evicted
        self.nodes: dict[int, RadixNode] = {0: self.root}
        self._next_id = 1
        self.num_evictable_blocks = 0        # blocks in unlocked nodes: what evict() could free
        self.clock = clock or ev.StepClock()   # the engine's step number: event stamps and last_access

    @property
    def step(self) -> int:
        """The engine's step number (read from the shared clock; only the engine advances it)."""
        return self.clock.step

    # -- lookup ------------------------------------------------------------------------

    def _key(self, tokens: Sequence[int], block: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(tokens[block * bs : (block + 1) * bs])

    def _common_blocks(self, node: RadixNode, tokens: Sequence[int], first_block: int, max_blocks: int) -> int:
        """How many whole blocks of `node`'s span equal the tokens from block `first_block` on."""
        n = 0
        while n < min(len(node.block_ids), max_blocks) and \
                self._key(node.tokens, n) == self._key(tokens, first_block + n):
            n += 1
        return n

    def match_prefix(self, tokens: Sequence[int]) -> tuple[RadixNode, list[int]]:
        """The deepest node whose path is a prefix of `tokens`, and the blocks along that path.

        At most `(len(tokens) - 1) // block_size` blocks match, so at least one
        token is left to compute. Nothing is locked or shared here.
        """
        max_blocks = (len(tokens) - 1) // self.block_size
        node, blocks = self.root, []
        while len(blocks) < max_blocks:
            child = node.children.get(self._key(tokens, len(blocks)))
            if child is None:
                break
            n = self._common_blocks(child, tokens, len(blocks), max_blocks - len(blocks))
            if n < len(child.block_ids):
                child = self._split(child, n)
            blocks += child.block_ids
            node = child
        return node, blocks

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` `match_prefix` would find now, changing nothing (no split,
        no LRU touch): what `POST /tokenize` of `nanoserve serve` reports."""
        max_blocks = (len(tokens) - 1) // self.block_size
        node, n = self.root, 0
        while n < max_blocks:
            child = node.children.get(self._key(tokens, n))
            if child is None:
                break
            common = self._common_blocks(child, tokens, n, max_blocks - n)
            n += common
            if common < len(child.block_ids):
                break
            node = child
        return n * self.block_size

    def touch(self, node: RadixNode) -> None:
        """Mark `node` and its ancestors as used now (for LRU eviction)."""
        for n in node.path():
            n.last_access = self.step

    # -- insert ------------------------------------------------------------------------

    def insert(self, seq_id: str, tokens: Sequence[int], block_ids: Sequence[int]
               ) -> tuple[RadixNode, list[tuple[int, int, int]]]:
        """Put the full blocks `block_ids` (holding `tokens`) in the tree.

        Returns the node at the end of their path and the duplicates:
        (table index, the caller's block, the cached block with the same tokens).
        New nodes take one reference on their blocks; they start unlocked.
        """
        assert len(tokens) >= len(block_ids) * self.block_size
        node, i, n = self.root, 0, len(block_ids)
        duplicates = []
        while i < n:
            key = self._key(tokens, i)
            child = node.children.get(key)
            if child is None:
                child = self._add_node(seq_id, node, tokens, block_ids, i, n)
                i = n
            else:
                common = self._common_blocks(child, tokens, i, n - i)
                if common < len(child.block_ids):
                    child = self._split(child, common)
                duplicates += [(i + j, block_ids[i + j], cached)
                               for j, cached in enumerate(child.block_ids) if block_ids[i + j] != cached]
                i += common
            node = child
        self.touch(node)
        return node, duplicates

    def _add_node(self, seq_id: str, parent: RadixNode, tokens: Sequence[int], block_ids: Sequence[int],
                  first: int, end: int) -> RadixNode:
        bs = self.block_size
        span = tuple(tokens[first * bs : end * bs])
        node = RadixNode(self._next_id, parent, span, list(block_ids[first:end]), self.step)
        self._next_id += 1
        self.pool.share(node.block_ids)          # the tree's own reference
        parent.children[self._key(span, 0)] = node
        self.nodes[node.node_id] = node
        self.num_evictable_blocks += len(node.block_ids)   # unlocked until a sequence locks it
        self.emit(ev.RadixInserted(self.step, seq_id, node.node_id, parent.node_id, self.span_text(list(span)),
                                   len(span), tuple(node.block_ids)))
        return node

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node` after `num_blocks` blocks; the new head node becomes its parent. Returns the head."""
        bs = self.block_size
        head = RadixNode(self._next_id, node.parent, node.tokens[: num_blocks * bs], node.block_ids[:num_blocks],
                         node.last_access)
        self._next_id += 1
        head.lock_count = node.lock_count        # everyone using the tail passes through the head
        node.parent.children[self._key(node.tokens, 0)] = head
        node.tokens, node.block_ids = node.tokens[num_blocks * bs :], node.block_ids[num_blocks:]
        node.parent = head
        head.children[self._key(node.tokens, 0)] = node
        self.nodes[head.node_id] = head
        self.emit(ev.RadixSplit(self.step, node.node_id, head.node_id, num_blocks,
                                self.span_text(list(head.tokens)), self.span_text(list(node.tokens))))
        return head

    # -- locks -------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """One more running sequence uses `node` (and so every node above it)."""
        for n in node.path():
            if n.lock_count == 0:
                self.num_evictable_blocks -= len(n.block_ids)
            n.lock_count += 1

    def unlock(self, node: RadixNode) -> None:
        for n in node.path():
            n.lock_count -= 1
            assert n.lock_count >= 0, f"radix node {n.node_id} unlocked more often than locked"
            if n.lock_count == 0:
                self.num_evictable_blocks += len(n.block_ids)

    # -- eviction ----------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks by evicting unlocked leaves, least recently used first.

        Returns how many blocks went back to the free queue (fewer if the tree ran out).
        """
        heap = [(n.last_access, n.node_id, n) for n in self.nodes.values() if not n.children and n.lock_count == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._key(leaf.tokens, 0)]
            del self.nodes[leaf.node_id]
            released = self.pool.free(leaf.block_ids)
            self.num_evictable_blocks -= len(leaf.block_ids)
            freed += len(released)
            self.emit(ev.RadixEvicted(self.step, leaf.node_id, tuple(released), leaf.last_access))
            if parent is not self.root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def clear(self) -> int:
        """Evict everything unlocked; returns the number of blocks freed."""
        return self.evict(self.pool.num_blocks)

    # -- inspection --------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(n.block_ids) for n in self.nodes.values())

    def held_blocks(self) -> list[list[int]]:
        """The block lists the tree holds a reference on (one per node), for the pool's check."""
        return [n.block_ids for n in self.nodes.values() if n is not self.root]

    def check_invariants(self, locks: dict[int, int]) -> None:
        """`locks` maps node id -> running sequences whose deepest locked node it is."""
        evictable = 0
        expected_locks: dict[int, int] = {}
        for node_id, count in locks.items():
            assert node_id in self.nodes, f"a sequence locks radix node {node_id}, which is not in the tree"
            for n in self.nodes[node_id].path():
                expected_locks[n.node_id] = expected_locks.get(n.node_id, 0) + count
        for node in self.nodes.values():
            if node is self.root:
                continue
            assert node.block_ids and len(node.tokens) == len(node.block_ids) * self.block_size, \
                f"radix node {node.node_id}: {len(node.tokens)} tokens for {len(node.block_ids)} blocks"
            assert node.parent.children.get(self._key(node.tokens, 0)) is node, \
                f"radix node {node.node_id} is not its parent's child under its first block"
            assert node.lock_count == expected_locks.get(node.node_id, 0), (
                f"radix node {node.node_id}: lock_count {node.lock_count} but "
                f"{expected_locks.get(node.node_id, 0)} sequences hold it")
            for block_id in node.block_ids:
                ref = self.pool.blocks[block_id].ref_count
                assert ref >= 1, f"radix node {node.node_id} holds free block {block_id}"
                if node.lock_count == 0:
                    assert ref == 1, f"unlocked radix node {node.node_id}: block {block_id} has {ref} holders"
            if node.lock_count == 0:
                evictable += len(node.block_ids)
        assert evictable == self.num_evictable_blocks, \
            f"num_evictable_blocks {self.num_evictable_blocks} but unlocked nodes hold {evictable}"

    def snapshot(self) -> list[dict]:
        """Nodes as plain data, parents before children (the root left out)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append({
                    "node_id": node.node_id, "parent_id": node.parent.node_id,
                    "text": self.span_text(list(node.tokens)), "num_tokens": len(node.tokens),
                    "block_ids": list(node.block_ids), "lock_count": node.lock_count,
                    "last_access": node.last_access,
                })
            stack.extend(sorted(node.children.values(), key=lambda n: -n.node_id))
        return out
