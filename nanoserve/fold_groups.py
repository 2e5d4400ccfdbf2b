"""Folding KV cache groups: the events of groups 1.. applied to the view state (kv_groups.py).

A model with one group (every model without a sliding window) never sends
these: its block events carry group 0 and `fold.py` applies them to
`block_table` as always. With several groups, the same block events carry
their group, and this module applies them to the sequence's `group_tables`
(indexed like `block_table`; -1 where a block left the group's window), plus:

* `BlocksLeftWindow`: a windowed group let go of blocks its window passed,
* `GroupsCached`: the prefix cache holds, with each new group-0 block, the
  blocks at the same position in the other groups (its companions), and
  `CompanionEvicted`: it let go of one (group_cache.py),
* `GroupsForked` and `PrefixMatched`'s `group_block_ids`: the other groups' shares.

It imports nothing but `events.py` and `view.py`, like fold.py.
"""

from __future__ import annotations

from nanoserve import events as ev
from nanoserve.view import SequenceView, ViewState

FREED = -1   # (kv_groups.FREED: a table entry whose block left the window)


def is_group_event(event: ev.Event) -> bool:
    """Does `fold_group_event` apply it (rather than fold.py's group-0 handling)?"""
    return isinstance(event, (ev.BlocksLeftWindow, ev.GroupsCached, ev.CompanionEvicted, ev.GroupsForked)) or \
        getattr(event, "group", 0) > 0


def _take(state: ViewState, blocks) -> None:
    for b in blocks:
        if b == FREED:
            continue
        if state.ref_counts[b] == 0 and b in state.free_queue:
            state.free_queue.remove(b)
        state.ref_counts[b] += 1
        state.touched_blocks.add(b)


def _drop(state: ViewState, blocks, released) -> None:
    for b in blocks:
        state.ref_counts[b] -= 1
        state.touched_blocks.add(b)
    state.free_queue.extend(released)


def _table(tables: list[list[int]], group: int) -> list[int]:
    """Group `group`'s table in `tables` (groups 1..), growing the list as needed."""
    while len(tables) < group:
        tables.append([])
    return tables[group - 1]


def fold_group_event(state: ViewState, req: SequenceView | None, event: ev.Event) -> None:
    """Apply one event of a group > 0 (or a group-only event) to `state`."""
    if isinstance(event, ev.GroupsCached):
        for block_id, companions in zip(event.block_ids, event.group_block_ids):
            state.companions[block_id] = list(companions)
            _take(state, companions)                     # the tree's reference on each
        return
    if isinstance(event, ev.GroupsForked):                # the child shares its parent's tables
        shared_groups(state, state.sequences[event.seq_id], event.group_block_ids)
        return
    if isinstance(event, ev.CompanionEvicted):           # the cache let go of one (group_cache.py)
        _drop(state, [event.companion], [event.companion] if event.released else [])
        companions = state.companions.get(event.block_id)
        if companions is not None:
            companions[event.group - 1] = FREED
            if all(c == FREED for c in companions) and event.block_id not in state.cached_blocks():
                del state.companions[event.block_id]     # (its group-0 block was evicted before)
        return
    if isinstance(event, ev.BlocksFreed):                # release, a trim, or an evicted block's companion
        _drop(state, event.block_ids, event.released)
        if req is not None:
            table = _table(req.group_tables, event.group)
            for b in event.block_ids:
                if b in table:
                    table.remove(b)
            if all(b == FREED for b in table):
                table.clear()
        return
    if req is None:
        raise ValueError(f"{type(event).__name__} for unknown request {getattr(event, 'seq_id', None)!r}")
    table = _table(req.group_tables, event.group)
    if isinstance(event, ev.BlocksAllocated):
        _take(state, event.block_ids)
        table.extend(event.block_ids)
    elif isinstance(event, ev.BlocksLeftWindow):
        _drop(state, event.block_ids, event.released)
        for i in event.indices:
            table[i] = FREED
        state.left_window.update(event.block_ids)
    elif isinstance(event, ev.BlockDeduplicated):
        _take(state, [event.kept])
        _drop(state, [event.dropped], [event.dropped] if event.released else [])
        table[event.index] = event.kept
    elif isinstance(event, ev.CowCopied):
        _drop(state, [event.src], [])
        _take(state, [event.dst])
        table[event.index] = event.dst
    elif isinstance(event, ev.SwappedOut):               # FREED entries stay FREED in the CPU copy
        _drop(state, event.block_ids, event.released)
        cpu = iter(event.cpu_block_ids)
        _table(req.cpu_group_tables, event.group)[:] = [FREED if b == FREED else next(cpu) for b in table]
        table.clear()
    elif isinstance(event, ev.SwappedIn):
        _take(state, event.block_ids)
        device = iter(event.block_ids)
        cpu_table = _table(req.cpu_group_tables, event.group)
        table[:] = [FREED if b == FREED else next(device) for b in cpu_table]
        cpu_table.clear()


def shared_groups(state: ViewState, req: SequenceView, group_block_ids: tuple[tuple[int, ...], ...]) -> None:
    """GroupsForked / PrefixMatched: `req` now holds these tables in groups 1.. (one more holder each live block)."""
    req.group_tables = [list(t) for t in group_block_ids]
    for table in group_block_ids:
        _take(state, table)


def forget_evicted(state: ViewState, event: ev.RadixEvicted) -> None:
    """The tree evicted group-0 blocks: their companions go with them (a CompanionEvicted each follows;
    an entry none is left in goes now)."""
    for b in event.block_ids:
        if all(c == FREED for c in state.companions.get(b, [FREED])):
            state.companions.pop(b, None)
