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

Blocks are plain ids here; tensors live in the runner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
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
                 emit: Callable[[ev.Event], None], clock: ev.StepClock | None = None) -> None:
        self.pool = pool
        self.radix = radix            # the prefix cache (the engine's `radix`); None: prefix caching is off
        self.cpu_pool = cpu_pool      # None: no swap space (preemption by recompute only)
        self.emit = emit
        # the engine's step number, for event stamps (built alone: the radix cache's, or a clock of its own)
        self.clock = clock or (radix.clock if radix is not None else ev.StepClock())
        self.num_lookup_tokens = 0    # prefix cache: tokens looked up at admission ...
        self.num_hit_tokens = 0       # ... and tokens whose prefill a hit skipped
        self.moves = BlockMoves()     # where this step's block moves go (the plan's, from begin_step)

    # -- room ----------------------------------------------------------------------------

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones nobody is using."""
        return self.pool.num_free_blocks + (self.radix.num_evictable_blocks if self.radix else 0)

    def evictable_in_path(self, node) -> int:
        """Blocks on the path to `node` that count as evictable now (a match is about to lock them)."""
        return sum(len(n.block_ids) for n in node.path() if n.lock_count == 0) if node is not None else 0

    def blocks_to_write(self, seq: Sequence, num_new: int) -> int:
        """Fresh blocks `seq` needs to write `num_new` more tokens (new blocks + a copy-on-write copy)."""
        return self.pool.blocks_needed(len(seq.block_table), seq.num_computed_tokens + num_new) + \
            int(self._shared_write_block(seq) is not None)

    def _take(self, n: int) -> list[int]:
        short = n - self.pool.num_free_blocks
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        return self.pool.allocate(n)

    def grow(self, seq: Sequence, num_new: int) -> None:
        """Blocks for `num_new` more tokens of `seq` (copy-on-write first, if its last block is shared)."""
        self.copy_on_write(seq)
        needed = self.pool.blocks_needed(len(seq.block_table), seq.num_computed_tokens + num_new)
        if needed:
            new_ids = self._take(needed)
            seq.block_table.extend(new_ids)
            self.emit(ev.BlocksAllocated(self.step, seq.seq_id, tuple(new_ids)))

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
        return self.radix.match_prefix(seq.all_token_ids)

    def commit_match(self, seq: Sequence, node, blocks: list[int]) -> None:
        """`seq` (no blocks yet) starts from the cached blocks: share them, lock their nodes."""
        if self.radix is None or seq.needs_prompt_logprobs:   # (it did not look: no lookup to count)
            return
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.num_lookup_tokens += seq.num_tokens
        self.num_hit_tokens += len(blocks) * self.pool.block_size
        self.emit(ev.PrefixMatched(self.step, seq.seq_id, seq.num_tokens,
                                   len(blocks) * self.pool.block_size, tuple(blocks)))
        if not blocks:
            return
        self.pool.share(blocks)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.pool.block_size
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
        """Put `seq`'s filled, computed blocks in the tree (no-op when nothing new filled)."""
        if self.radix is None:
            return
        # (A request that stopped inside an accepted speculative run has KV past its last kept token.)
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.pool.block_size
        if num_full <= _depth_blocks(seq.cache_node):
            return
        node, duplicates = self.radix.insert(seq.seq_id, seq.token_ids(0, num_full * self.pool.block_size),
                                             seq.block_table[:num_full])
        for index, own, cached in duplicates:
            self.pool.share([cached])
            released = self.pool.free([own])
            seq.block_table[index] = cached
            self.emit(ev.BlockDeduplicated(self.step, seq.seq_id, index, own, cached, bool(released)))
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
        if seq.block_table:
            released = self.pool.free(seq.block_table)
            self.emit(ev.BlocksFreed(self.step, seq.seq_id, tuple(seq.block_table), tuple(released)))
            seq.block_table = []
        if seq.cpu_block_table:
            self.cpu_pool.free(seq.cpu_block_table)
            seq.cpu_block_table = []

    def trim(self, seq: Sequence) -> tuple[int, ...]:
        """Free the blocks past the sequence's computed tokens (KV of rejected drafts)."""
        keep = self.pool.blocks_needed(0, seq.num_computed_tokens)
        extra = seq.block_table[keep:]
        if not extra:
            return ()
        released = self.pool.free(extra)
        del seq.block_table[keep:]
        self.emit(ev.BlocksFreed(self.step, seq.seq_id, tuple(extra), tuple(released)))
        return tuple(extra)

    # -- swap ---------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.cpu_pool is not None and len(seq.block_table) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq: Sequence) -> None:
        """Copy `seq`'s KV to CPU blocks and free its device blocks (the copy runs before the forward)."""
        cpu_ids = self.cpu_pool.allocate(len(seq.block_table))
        self.moves.swap_out += zip(seq.block_table, cpu_ids)
        if seq.cache_node is not None:
            self._relock(seq, None)
        gpu_ids = seq.block_table
        released = self.pool.free(gpu_ids)
        seq.block_table, seq.cpu_block_table = [], cpu_ids
        self.emit(ev.SwappedOut(self.step, seq.seq_id, tuple(gpu_ids), tuple(released), tuple(cpu_ids)))

    def swap_in(self, seq: Sequence) -> None:
        """Fresh device blocks for a swapped sequence, filled from its CPU blocks."""
        gpu_ids = self._take(len(seq.cpu_block_table))
        self.moves.swap_in += zip(seq.cpu_block_table, gpu_ids)
        cpu_ids = seq.cpu_block_table
        self.cpu_pool.free(cpu_ids)
        seq.cpu_block_table, seq.block_table = [], gpu_ids
        self.emit(ev.SwappedIn(self.step, seq.seq_id, tuple(cpu_ids), tuple(gpu_ids)))

    # -- invariants ---------------------------------------------------------------------------

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        tables = [s.block_table for s in running]
        if self.radix is not None:
            tables += self.radix.held_blocks()
            locks = Counter(s.cache_node.node_id for s in running if s.cache_node is not None)
            self.radix.check_invariants(dict(locks))
            for s in running:   # a sequence's table starts with the blocks of its locked path
                path = [b for n in reversed(s.cache_node.path()) for b in n.block_ids] if s.cache_node else []
                assert s.block_table[: len(path)] == path, f"{s.seq_id}: table does not start with its cached path"
        self.pool.check_invariants(tables)
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants([s.cpu_block_table for s in swapped])
        for s in swapped:
            assert not s.block_table and s.cache_node is None, f"{s.seq_id}: swapped but holds device blocks"
            assert len(s.cpu_block_table) == self.pool.blocks_needed(0, s.num_computed_tokens), \
                f"{s.seq_id}: {len(s.cpu_block_table)} CPU blocks for {s.num_computed_tokens} tokens"


def _depth_blocks(node) -> int:
    """Blocks on the path from the root down to `node` (0 for the root or None)."""
    return sum(len(n.block_ids) for n in node.path()) if node is not None else 0
