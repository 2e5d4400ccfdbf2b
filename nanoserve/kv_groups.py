"""KV cache groups: one block table per kind of attention, one shared pool, blocks freed as a window slides.

A sliding-window layer (Gemma 3's local layers, window W) reads only the last
W positions: a query at position p sees keys p - W + 1 .. p. Once a sequence
has computed `c` tokens, every later query is at p >= c, so a key j with
j <= c - W is never read again by a local layer. If the local layers kept
their own block table, the blocks holding only such keys could go back to
the pool: the memory a long request holds in its local layers stops growing
at about W / block_size blocks.

That needs the local and the global layers to hold *different* blocks, so
the layers are split into groups, as vLLM's hybrid KV cache manager does:

    layers  L0(local) L1(local) L2(full)      group size = gcd of the kinds' layer counts = 1
    groups  g0 = [L2] (full)   g1 = [L0] (W)   g2 = [L1] (W)

Every group has the same number of layers, so one block id means the same
bytes in any group: a block is `block_size` tokens of K/V for `group_size`
layers, and slot s of every group (the s-th layer of each) shares one KV
tensor `[num_blocks, block_size, kv_heads, head_dim]`. The pool is shared; a
sequence holds one table per group, all indexed the same way (entry i covers
tokens [i*bs, (i+1)*bs)). A windowed group's entries for blocks that left the
window are `FREED` (-1): the block went back to the pool (or stays only in the
prefix cache), and the attention mask would never have read it.

Group 0 is a full-attention group when the model has one, so `seq.block_table`
(group 0's) always covers every computed token, as it does for a model with
one group; `seq.group_tables` holds groups 1.. (empty with one group: every
model without a window, and a windowed model with freeing off, keep exactly
the structures of before). A one-group model *is* the lab's world: one table
per sequence, the pool, the tree. Groups repeat that table once per kind of
layer and let a windowed one drop its head.

This module holds the grouping and the window arithmetic; kv_manager.py does
the block work with them, runner.py gives each layer its group's tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FREED = -1   # a windowed group's table entry whose block left the window (no block held there)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table: same attention kind, `group_size` of them."""

    window: int | None          # sliding window of its layers (None: full attention)
    layers: tuple[int, ...]     # model layer indices, in order; layer i of the group uses KV slot i


def make_groups(windows: list[int | None], freeing: bool) -> list[KVGroup]:
    """The KV cache groups of a model whose layer l has window `windows[l]` (None: full attention).

    Without freeing, or without both kinds, one group holds every layer (today's layout). Otherwise each kind's layers are cut, in order, into groups of gcd(kind counts)
    layers: full-attention groups first, so group 0's table covers the whole context."""
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if not freeing or None not in kinds or len(kinds) == 1:
        # (every layer windowed, as in Mistral's first release: group 0 must hold every token, so no freeing)
        return [KVGroup(None, tuple(range(len(windows))))]
    per_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = math.gcd(*(len(layers) for layers in per_kind.values()))
    return [KVGroup(w, tuple(per_kind[w][i : i + size])) for w in kinds for i in range(0, len(per_kind[w]), size)]


def first_needed_block(window: int | None, num_computed: int, block_size: int) -> int:
    """Index of the first block a group still needs once `num_computed` tokens have KV: every later
    query (position >= num_computed) sees keys >= num_computed - window + 1."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def max_window_blocks(window: int, block_size: int) -> int:
    """The most blocks a windowed table holds between steps: the window's W - 1 keys behind the next
    query span at most ceil((W - 1) / bs) + 1 blocks (the invariant `check_invariants` checks)."""
    return -(-(window - 1) // block_size) + 1


def live(table: list[int]) -> list[int]:
    """The blocks a table really holds (its `FREED` entries left out)."""
    return [b for b in table if b != FREED]
