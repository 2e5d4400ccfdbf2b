"""The prefix cache across KV cache groups: the blocks of groups 1.. the tree keeps with group 0's.

The radix tree (radix_cache.py) knows one table: group 0's, which holds every
token. With several groups (kv_groups.py) a cached position needs its block in
every group, so for each group-0 block the tree holds, this keeps its
*companions*: the blocks at the same position in groups 1.., with one
reference each (the tree's, held here). Cached with group 0's block as it
fills, before a window passes it, and freed when the tree evicts it.

A windowed group's companion is needed only by a prefix hit ending within a
window of it, so it may go before its group-0 block: once no sequence holds
it (a sliding window passed it), it is cached and evictable, even under a
locked node, and `evict` takes those first. A hit is then cut back to the
longest prefix whose windowed groups still have the companions their window
needs (`usable`): the simplest rule that keeps every hit exact and lets the
memory a window passed go back to the pool when the pool is short.

Blocks are plain ids; `pool` is the engine's block pool, `emit` its events.
"""

from __future__ import annotations

from collections.abc import Callable

from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
from nanoserve.kv_groups import FREED, KVGroup, first_needed_block


class GroupCache:
    def __init__(self, pool: BlockPool, groups: list[KVGroup], emit: Callable[[ev.Event], None],
                 clock: ev.StepClock) -> None:
        self.pool, self.groups, self.emit, self.clock = pool, groups, emit, clock
        # group 0's cached block -> its companions in groups 1.. (FREED: evicted alone, windowed groups only)
        self.companions: dict[int, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Companion blocks held for the tree."""
        return sum(c != FREED for cs in self.companions.values() for c in cs)

    @property
    def num_evictable(self) -> int:
        """Companions only the tree holds (no sequence's table): free for the taking."""
        return sum(c != FREED and self.pool.blocks[c].ref_count == 1 for cs in self.companions.values() for c in cs)

    def held(self) -> list[list[int]]:
        """The blocks held for the tree, for the pool's check."""
        return [[c for c in cs if c != FREED] for cs in self.companions.values()]

    def add(self, seq_id: str, block_ids: list[int], group_tables: list[list[int]], positions: list[int]) -> None:
        """Group 0's blocks at `positions` were just cached: keep the other groups' blocks there too."""
        new = [i for i in positions if block_ids[i] not in self.companions]
        for i in new:
            self.companions[block_ids[i]] = companions = [t[i] for t in group_tables]
            self.pool.share(companions)
        if new:
            self.emit(ev.GroupsCached(self.clock.step, seq_id, tuple(block_ids[i] for i in new),
                                      tuple(tuple(self.companions[block_ids[i]]) for i in new)))

    def dedup(self, block_id: int, group: int) -> int:
        """The cached block at cached group-0 block `block_id`'s position in `group` (FREED: evicted alone,
        and the sequence keeps its own)."""
        return self.companions[block_id][group - 1]

    def usable(self, blocks: list[int]) -> int:
        """How many of the hit's `blocks` can be used: the longest prefix whose windowed groups still have
        the companions their windows need at its end (full groups keep all theirs)."""
        bs = self.pool.block_size
        for k in range(len(blocks), 0, -1):
            if all(self.companions[b][g - 1] != FREED for g, group in enumerate(self.groups[1:], 1)
                   for b in blocks[first_needed_block(group.window, k * bs, bs):k]):
                return k
        return 0

    def tables_for(self, blocks: list[int]) -> list[list[int]]:
        """Groups 1..'s tables for a sequence starting from the hit `blocks`: the companions each group's
        window still needs, FREED before."""
        hit, bs = len(blocks) * self.pool.block_size, self.pool.block_size
        tables = []
        for g, group in enumerate(self.groups[1:]):
            first = first_needed_block(group.window, hit, bs)
            tables.append([FREED] * first + [self.companions[b][g] for b in blocks[first:]])
        return tables

    def evict_alone(self, n: int) -> int:
        """Free up to `n` companions that only the tree holds (oldest cached first); returns how many."""
        freed = 0
        for block_id, companions in self.companions.items():
            for g, c in enumerate(companions, 1):
                if freed < n and c != FREED and self.pool.blocks[c].ref_count == 1 and \
                        self.groups[g].window is not None:
                    freed += self._free(block_id, g)
            if freed >= n:
                break
        return freed

    def forget_evicted(self) -> int:
        """The tree evicted group-0 blocks (ref count 0 now): free their companions; returns how many."""
        freed = 0
        for block_id in [b for b in self.companions if self.pool.blocks[b].ref_count == 0]:
            freed += sum(self._free(block_id, g) for g, c in enumerate(self.companions[block_id], 1) if c != FREED)
            del self.companions[block_id]
        return freed

    def _free(self, block_id: int, group: int) -> int:
        c = self.companions[block_id][group - 1]
        released = self.pool.free([c])
        self.companions[block_id][group - 1] = FREED
        self.emit(ev.CompanionEvicted(self.clock.step, block_id, group, c, bool(released)))
        return len(released)
