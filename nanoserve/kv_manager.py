"""The KV manager: how a sequence's blocks change, for every memory mechanism.

The scheduler decides *who* runs, waits, is preempted or swapped; this module
does the block work that goes with each decision and says so in events:

* `grow`: new blocks for the tokens a sequence is about to compute. When the
  free queue is short it first evicts cached blocks (`RadixCache.evict`).
* `match`/`commit_match`: a waiting sequence starts from the longest cached
  prefix (its prefill is skipped for those tokens) and locks those nodes.
* `cache_full_blocks`: after a step, blocks that filled up enter the radix
  tree; a block whose tokens the tree already holds in another block is
  swapped for the cached one (same tokens, same KV) and freed.
* `fork`: a child shares every block of its parent (ref count + 1 each).
* `copy_on_write`: before a sequence writes into a block someone else also
  holds, it gets a fresh block and a device copy of the shared one
  (into the plan's `BlockMoves`, executed by the runner before the forward).
* `swap_out`/`swap_in`: a preempted sequence's KV moves to the CPU pool and
  back (block pairs, also into the plan's `BlockMoves`, executed by the runner).
* `release`: unlock the cache path and drop the table (finish, abort, preempt).
* `slide`: with KV cache groups (kv_groups.py), a windowed group's blocks that left
  its window go back (`BlocksLeftWindow`); every operation above works on each
  group's table. With one group (every model without a window) it is exactly the
  one table of before.

Blocks are plain ids here; tensors live in the runner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
from nanoserve.group_cache import GroupCache
from nanoserve.kv_groups import FREED, KVGroup, first_needed_block, live, max_window_blocks
from nanoserve.radix_cache import RadixCache
from nanoserve.sequence import Sequence


@dataclass(slots=True)
class BlockMoves:
    """The KV copies one step's plan asks the runner to make before its forward pass.

    The scheduler creates one per step, in its plan, and hands it to the KV manager
    (`begin_step`), which records each move there as it decides it.
    """

    copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write (src, dst) device blocks
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, CPU block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (CPU block, device block)


class KVManager:
    def __init__(self, pool: BlockPool, radix: RadixCache | None, cpu_pool: BlockPool | None,
                 emit: Callable[[ev.Event], None], clock: ev.StepClock | None = None,
                 groups: list[KVGroup] | None = None) -> None:
        self.pool = pool
        self.radix = radix            # the prefix cache (the engine's `radix`); None: prefix caching is off
        self.cpu_pool = cpu_pool      # None: no swap space (preemption by recompute only)
        self.emit = emit
        # the engine's step number, for event stamps (built alone: the radix cache's, or a clock of its own)
        self.clock = clock or (radix.clock if radix is not None else ev.StepClock())
        self.num_lookup_tokens = 0    # prefix cache: tokens looked up at admission ...
        self.num_hit_tokens = 0       # ... and tokens whose prefill a hit skipped
        self.moves = BlockMoves()     # where this step's block moves go (the plan's, from begin_step)
        self.groups = groups or [KVGroup(None, ())]   # KV cache groups; group 0 holds every token
        # The prefix cache with several groups: for each block the tree holds, the blocks at the same position
        # in groups 1.. (group_cache.py)
        self.group_cache = GroupCache(pool, self.groups, emit, self.clock)
        if radix is not None and len(self.groups) > 1:
            # Whoever evicts from the tree (this manager, or a caller of radix.evict), the evicted blocks'
            # companions go with them: the tree's events pass through here first.
            tree_emit = radix.emit

            def emit_and_forget(event: ev.Event) -> None:
                tree_emit(event)
                if isinstance(event, ev.RadixEvicted):
                    self.group_cache.forget_evicted()
            radix.emit = emit_and_forget

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table in every group: [block_table, *group_tables]."""
        if len(seq.group_tables) != len(self.groups) - 1:
            assert not seq.block_table and not any(seq.group_tables), f"{seq.seq_id}: tables of another grouping"
            seq.group_tables = [[] for _ in self.groups[1:]]
        return [seq.block_table, *seq.group_tables]

    # -- room ----------------------------------------------------------------------------

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones nobody is using."""
        # (KV cache groups: and the companions in the other groups only the cache holds, group_cache.py)
        if self.radix is None:
            return self.pool.num_free_blocks
        alone = self.group_cache.num_evictable if len(self.groups) > 1 else 0
        return self.pool.num_free_blocks + self.radix.num_evictable_blocks + alone

    def evictable_in_path(self, node) -> int:
        """Blocks on the path to `node` that count as evictable now (a match is about to lock them, and
        share their companions)."""
        if node is None:
            return 0
        companions = [c for n in node.path() for b in n.block_ids for c in self.group_cache.companions.get(b, ())]
        return sum(len(n.block_ids) for n in node.path() if n.lock_count == 0) + \
            sum(c != FREED and self.pool.blocks[c].ref_count == 1 for c in companions)

    def blocks_to_write(self, seq: Sequence, num_new: int) -> int:
        """Fresh blocks `seq` needs to write `num_new` more tokens (new blocks + copy-on-write copies)."""
        bs, i = self.pool.block_size, seq.num_computed_tokens // self.pool.block_size
        shared = [seq.num_computed_tokens % bs and i < len(t) and self.pool.blocks[t[i]].ref_count > 1
                  for t in seq.group_tables]             # (copy-on-write in groups 1..)
        return sum(self.pool.blocks_needed(len(t), seq.num_computed_tokens + num_new) for t in self.tables(seq)) + \
            int(self._shared_write_block(seq) is not None) + sum(map(bool, shared))

    def blocks_for(self, num_tokens: int, num_new: int, num_held: int = 0) -> int:
        """Blocks a sequence needs, beyond the first `num_held` of each table, to hold `num_tokens` tokens of
        KV while the last `num_new` are computed (a windowed group only from its window on)."""
        end = -(-num_tokens // self.pool.block_size)
        return sum(max(0, end - max(num_held, first_needed_block(g.window, num_tokens - num_new,
                                                                self.pool.block_size))) for g in self.groups)

    def blocks_to_swap_in(self, seq: Sequence, num_new: int) -> int:
        """Device blocks a swapped `seq` needs to come back and compute `num_new` more tokens."""
        return sum(len(live(t)) + self.pool.blocks_needed(len(t), seq.num_computed_tokens + num_new)
                   for t in [seq.cpu_block_table, *seq.cpu_group_tables])

    def _take(self, n: int) -> list[int]:
        short = n - self.pool.num_free_blocks
        if short > 0 and self.radix is not None:
            self.evict(short)
        return self.pool.allocate(n)

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` cached blocks: companions only the cache holds first (a window passed
        them), then the tree's least recently used leaves with their companions; returns blocks freed."""
        if len(self.groups) == 1:
            return self.radix.evict(num_blocks)
        free = self.pool.num_free_blocks
        freed = self.group_cache.evict_alone(num_blocks)
        if freed < num_blocks:
            self.radix.evict(num_blocks - freed)   # (their companions go too: see __init__)
        return self.pool.num_free_blocks - free

    def clear_cache(self) -> int:
        """Evict everything the prefix cache holds unlocked; returns the number of blocks freed."""
        return self.evict(self.pool.num_blocks) if self.radix is not None else 0

    def grow(self, seq: Sequence, num_new: int) -> None:
        """Blocks for `num_new` more tokens of `seq` in every group (blocks that left a window go first,
        then copy-on-write, if its last block is shared)."""
        tables = self.tables(seq)
        self.slide(seq)
        self.copy_on_write(seq)
        self._copy_on_write_groups(seq)
        for g, table in enumerate(tables):
            needed = self.pool.blocks_needed(len(table), seq.num_computed_tokens + num_new)
            if needed:
                new_ids = self._take(needed)
                table.extend(new_ids)
                self.emit(ev.BlocksAllocated(self.step, seq.seq_id, tuple(new_ids), g))

    def slide(self, seq: Sequence) -> None:
        """A windowed group lets go of the blocks its window has passed: no query from
        `num_computed_tokens` on reads them (kv_groups.py). Their entries become FREED."""
        for g, table in enumerate(self.tables(seq)[1:], 1):
            window = self.groups[g].window
            first = min(first_needed_block(window, seq.num_computed_tokens, self.pool.block_size), len(table))
            indices = [i for i in range(first) if table[i] != FREED]
            if not indices:
                continue
            blocks = [table[i] for i in indices]
            released = self.pool.free(blocks)
            for i in indices:
                table[i] = FREED
            self.emit(ev.BlocksLeftWindow(self.step, seq.seq_id, g, window, seq.num_computed_tokens,
                                          tuple(indices), tuple(blocks), tuple(released)))

    # -- copy-on-write ---------------------------------------------------------------------

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index of the partly filled block `seq` writes next, if another table holds it too."""
        bs = self.pool.block_size
        i = seq.num_computed_tokens // bs
        if seq.num_computed_tokens % bs and i < len(seq.block_table) and \
                self.pool.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """Give `seq` its own copy of a shared block it is about to write into; returns (src, dst)."""
        i = self._shared_write_block(seq)
        if i is None:
            return None
        src = seq.block_table[i]
        dst = self._take(1)[0]
        self.pool.free([src])                  # one holder fewer; the others keep it
        seq.block_table[i] = dst
        self.moves.copies.append((src, dst))
        self.emit(ev.CowCopied(self.step, seq.seq_id, i, src, dst))
        return src, dst

    def _copy_on_write_groups(self, seq: Sequence) -> None:
        """`copy_on_write` in KV cache groups 1.. (kv_groups.py): the block each group writes next, if shared."""
        bs, i = self.pool.block_size, seq.num_computed_tokens // self.pool.block_size
        for g, table in enumerate(seq.group_tables, 1):
            if seq.num_computed_tokens % bs and i < len(table) and self.pool.blocks[table[i]].ref_count > 1:
                src, dst = table[i], self._take(1)[0]
                self.pool.free([src])
                table[i] = dst
                self.moves.copies.append((src, dst))
                self.emit(ev.CowCopied(self.step, seq.seq_id, i, src, dst, g))

    @property
    def step(self) -> int:
        """The engine's step number (read from the shared clock; only the engine advances it)."""
        return self.clock.step

    def begin_step(self, moves: BlockMoves) -> None:
        """A new step's plan: the block moves decided from now on are recorded in `moves`."""
        self.moves = moves

    # -- prefix cache -------------------------------------------------------------------------

    def match(self, seq: Sequence):
        """The longest cached prefix of `seq`'s tokens: (node, block ids). Changes no ref counts.

        A sequence that still needs prompt log-probabilities does not look: a hit would skip the
        forward of the very positions whose logits give them (prompt_logprobs.py)."""
        if self.radix is None or seq.needs_prompt_logprobs:
            return None, []
        node, blocks = self.radix.match_prefix(seq.all_token_ids)
        usable = self.group_cache.usable(blocks) if len(self.groups) > 1 else len(blocks)
        if usable < len(blocks):   # (KV cache groups: a window's companions went, group_cache.py)
            node, blocks = self.radix.match_prefix(seq.token_ids(0, usable * self.pool.block_size + 1))
        return node, blocks

    def commit_match(self, seq: Sequence, node, blocks: list[int]) -> None:
        """`seq` (no blocks yet) starts from the cached blocks: share them, lock their nodes. In a windowed
        group it takes only the cached blocks its window still needs (the rest stay cached)."""
        if self.radix is None or seq.needs_prompt_logprobs:   # (it did not look: no lookup to count)
            return
        assert not seq.block_table and seq.num_computed_tokens == 0
        hit = len(blocks) * self.pool.block_size
        groups = self.group_cache.tables_for(blocks)
        self.num_lookup_tokens += seq.num_tokens
        self.num_hit_tokens += hit
        self.emit(ev.PrefixMatched(self.step, seq.seq_id, seq.num_tokens, hit, tuple(blocks),
                                   tuple(tuple(t) for t in groups) if blocks else ()))
        if not blocks:
            return
        self.pool.share(blocks)
        for table in groups:
            self.pool.share(live(table))
        seq.block_table, seq.group_tables = list(blocks), groups
        seq.num_computed_tokens = hit
        self.radix.touch(node)
        self._relock(seq, node)

    def _relock(self, seq: Sequence, node) -> None:
        if node is seq.cache_node:
            return
        if node is not None and node is not self.radix.root:
            self.radix.lock(node)
        else:
            node = None
        if seq.cache_node is not None:
            self.radix.unlock(seq.cache_node)
        seq.cache_node = node
        self.emit(ev.RadixLocked(self.step, seq.seq_id, node.node_id if node is not None else 0))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Put `seq`'s filled, computed blocks in the tree (no-op when nothing new filled). With several
        groups the tree holds group 0's and each one's companions (blocks cache as they fill, before
        a window passes them)."""
        if self.radix is None:
            return
        # (A request that stopped inside an accepted speculative run has KV past its last kept token.)
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.pool.block_size
        depth = _depth_blocks(seq.cache_node)
        for table in seq.group_tables:   # (only whole positions: every group still holding its block)
            num_full = next((i for i in range(depth, num_full) if table[i] == FREED), num_full)
        if num_full <= depth:
            return
        node, duplicates = self.radix.insert(seq.seq_id, seq.token_ids(0, num_full * self.pool.block_size),
                                             seq.block_table[:num_full])
        for index, own, cached in duplicates:
            for g, table in enumerate(self.tables(seq)):
                own, cached_g = table[index], cached if g == 0 else self.group_cache.dedup(cached, g)
                if cached_g == FREED or own == FREED:   # (the cache lost it; or the window passed it)
                    continue
                self.pool.share([cached_g])
                released = self.pool.free([own])
                table[index] = cached_g
                self.emit(ev.BlockDeduplicated(self.step, seq.seq_id, index, own, cached_g, bool(released), g))
        if seq.group_tables:                # newly cached blocks: the tree keeps their companions too
            self.group_cache.add(seq.seq_id, seq.block_table, seq.group_tables, list(range(depth, num_full)))
        self._relock(seq, node)

    # -- fork ---------------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence, seed: int = -1) -> None:
        """`child` (a copy of `parent`'s tokens) shares all of `parent`'s blocks and cache locks.
        (`seed`, the seed of the child's RNG, is only reported in the event.)"""
        self.pool.share(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self.emit(ev.Forked(self.step, parent.seq_id, child.seq_id, tuple(child.block_table), seed))
        if parent.cache_node is not None:
            self._relock(child, parent.cache_node)

    def fork_groups(self, parent: Sequence, child: Sequence) -> None:
        """After `fork`: `child` shares `parent`'s tables in KV cache groups 1.. too (kv_groups.py)."""
        child.group_tables = [list(t) for t in parent.group_tables]
        for table in child.group_tables:
            self.pool.share(live(table))
        self.emit(ev.GroupsForked(self.step, parent.seq_id, child.seq_id, tuple(map(tuple, child.group_tables))))

    # -- release ----------------------------------------------------------------------------

    def release(self, seq: Sequence, *, cache_kv: bool) -> None:
        """Drop everything `seq` holds: its cache locks, its device blocks, its CPU blocks.

        With `cache_kv` its filled blocks go into the prefix cache first (their KV is valid,
        whether it finished, was aborted or preempted), so a later request, or its own
        recompute, hits them; every caller says which (False: KV a failed step left unwritten).
        """
        if seq.block_table and cache_kv:
            self.cache_full_blocks(seq)
        if seq.cache_node is not None:
            self._relock(seq, None)
        for g, table in enumerate([seq.block_table, *seq.group_tables]):
            if ids := live(table):
                released = self.pool.free(ids)
                self.emit(ev.BlocksFreed(self.step, seq.seq_id, tuple(ids), tuple(released), g))
        seq.block_table, seq.group_tables = [], []
        for table in [seq.cpu_block_table, *seq.cpu_group_tables]:
            self.cpu_pool.free(live(table)) if live(table) else None
        seq.cpu_block_table, seq.cpu_group_tables = [], []

    def trim(self, seq: Sequence) -> tuple[int, ...]:
        """Free the blocks past the sequence's computed tokens (KV of rejected drafts); returns group 0's."""
        keep = self.pool.blocks_needed(0, seq.num_computed_tokens)
        trimmed = ()
        for g, table in enumerate(self.tables(seq)):
            extra = table[keep:]
            if not extra:
                continue
            released = self.pool.free(extra)
            del table[keep:]
            self.emit(ev.BlocksFreed(self.step, seq.seq_id, tuple(extra), tuple(released), g))
            trimmed = trimmed or tuple(extra)
        return trimmed

    # -- swap ---------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.cpu_pool is not None and \
            sum(len(live(t)) for t in self.tables(seq)) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq: Sequence) -> None:
        """Copy `seq`'s KV to CPU blocks and free its device blocks (the copy runs before the forward);
        a windowed group's FREED entries stay FREED."""
        tables = self.tables(seq)
        if seq.cache_node is not None:
            self._relock(seq, None)
        cpu_tables = []
        for g, table in enumerate(tables):
            gpu_ids = live(table)
            cpu_ids = iter(self.cpu_pool.allocate(len(gpu_ids)))
            cpu_tables.append([FREED if b == FREED else next(cpu_ids) for b in table])
            self.moves.swap_out += zip(gpu_ids, live(cpu_tables[-1]))
            released = self.pool.free(gpu_ids)
            self.emit(ev.SwappedOut(self.step, seq.seq_id, tuple(gpu_ids), tuple(released),
                                    tuple(live(cpu_tables[-1])), g))
        seq.block_table, seq.group_tables = [], []
        seq.cpu_block_table, seq.cpu_group_tables = cpu_tables[0], cpu_tables[1:]

    def swap_in(self, seq: Sequence) -> None:
        """Fresh device blocks for a swapped sequence, filled from its CPU blocks."""
        gpu_tables = []
        for g, table in enumerate([seq.cpu_block_table, *seq.cpu_group_tables]):
            cpu_ids = live(table)
            gpu_ids = iter(self._take(len(cpu_ids)))
            gpu_tables.append([FREED if b == FREED else next(gpu_ids) for b in table])
            self.moves.swap_in += zip(cpu_ids, live(gpu_tables[-1]))
            self.cpu_pool.free(cpu_ids)
            self.emit(ev.SwappedIn(self.step, seq.seq_id, tuple(cpu_ids), tuple(live(gpu_tables[-1])), g))
        seq.cpu_block_table, seq.cpu_group_tables = [], []
        seq.block_table, seq.group_tables = gpu_tables[0], gpu_tables[1:]

    # -- invariants ---------------------------------------------------------------------------

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        tables = [live(t) for s in running for t in self.tables(s)]
        if self.radix is not None:
            tables += self.radix.held_blocks() + self.group_cache.held()
            locks = Counter(s.cache_node.node_id for s in running if s.cache_node is not None)
            self.radix.check_invariants(dict(locks))
            cached = self.group_cache.companions
            for s in running:   # a sequence's table starts with the blocks of its locked path
                path = [b for n in reversed(s.cache_node.path()) for b in n.block_ids] if s.cache_node else []
                assert s.block_table[: len(path)] == path, f"{s.seq_id}: table does not start with its cached path"
                for g, table in enumerate(s.group_tables):
                    assert all(FREED in (t, cached[b][g]) or t == cached[b][g] for t, b in zip(table, path)), \
                        f"{s.seq_id}: group {g + 1} does not start with its cached path"
            assert set(cached) <= {b for n in self.radix.held_blocks() for b in n}, "companions leaked"
        self.pool.check_invariants(tables)
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants([live(t) for s in swapped
                                            for t in [s.cpu_block_table, *s.cpu_group_tables]])
        for s in swapped:
            assert not s.block_table and s.cache_node is None, f"{s.seq_id}: swapped but holds device blocks"
            assert len(s.cpu_block_table) == self.pool.blocks_needed(0, s.num_computed_tokens), \
                f"{s.seq_id}: {len(s.cpu_block_table)} CPU blocks for {s.num_computed_tokens} tokens"
        for s in running:
            self.check_windows(s.seq_id, s.group_tables, s.num_computed_tokens)
        for s in swapped:
            self.check_windows(s.seq_id, s.cpu_group_tables, s.num_computed_tokens)

    def check_windows(self, seq_id: str, group_tables: list[list[int]], num_computed: int) -> None:
        """Each group's table is as long as group 0's; a windowed one holds exactly the blocks its window
        still needs: FREED before, live from there, at most max_window_blocks of them."""
        bs = self.pool.block_size
        for g, table in enumerate(group_tables, 1):
            assert len(table) == self.pool.blocks_needed(0, num_computed), \
                f"{seq_id}: group {g} has {len(table)} blocks for {num_computed} computed tokens"
            window = self.groups[g].window
            first = first_needed_block(window, num_computed, bs)
            assert all(b == FREED for b in table[:first]) and FREED not in table[first:], \
                f"{seq_id}: group {g} holds blocks outside its window from block {first}: {table}"
            if window is not None:
                assert len(live(table)) <= max_window_blocks(window, bs), \
                    f"{seq_id}: group {g} holds {len(live(table))} blocks, more than its window's"


def _depth_blocks(node) -> int:
    """Blocks on the path from the root down to `node` (0 for the root or None)."""
    return sum(len(n.block_ids) for n in node.path()) if node is not None else 0
