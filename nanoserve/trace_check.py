"""Checking a trace before a viewer draws it: field types and block ids.

A JSONL trace is a file, and files come from anywhere: an older version, a
hand edit, a truncated copy. `read_trace` checks that each line names a known
event with the right field *names*; this module checks the rest that a viewer
relies on, so that a bad file gets one sentence instead of a traceback from
deep inside `fold`:

* every field holds the type its event declares (`tuple[int, ...]` is a list
  of ints in JSON; an `int` is never a bool or a string), and
* every block id lies inside the pool the trace's `EngineSynced` announced
  (CPU block ids inside the CPU pool), and
* the fields of some events agree with each other (`FIELD_CHECKS`: a
  structured-output mask allows between 0 and V tokens).

    check_trace(read_trace(path), path)     # ValueError("pressure.jsonl: event 12 (BlocksAllocated) ...")

`nanoserve export` and `nanoserve tui --replay` call it on every trace they open.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable
from pathlib import Path

from nanoserve import events as ev

# Fields that hold ids of device (GPU/CPU pool) blocks, and of CPU swap blocks.
BLOCK_FIELDS = ("block_ids", "free_queue", "kept", "dropped", "src", "dst")
CPU_BLOCK_FIELDS = ("cpu_block_ids",)
# EngineSynced.requests rows: index of the block table and the CPU block table
SYNCED_TABLE, SYNCED_CPU_TABLE = 7, 10
SYNCED_RADIX_BLOCKS = 4    # EngineSynced.radix rows: index of the node's block ids


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def conforms(value: object, hint: object) -> bool:
    """Does a value read from JSON (and turned into tuples) have the declared type `hint`?"""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:                      # JSON may write 2.0 as 2
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple:
        return isinstance(value, tuple)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args))
    return isinstance(value, hint) if isinstance(hint, type) else True


def type_name(hint: object) -> str:
    """`int`, `tuple[int, ...]`: how the hint reads in the event's source."""
    if typing.get_args(hint) or not hasattr(hint, "__name__"):
        return str(hint).replace("typing.", "")
    return hint.__name__


def check_types(event: ev.Event) -> None:
    """ValueError naming the first field whose value does not have its declared type."""
    hints = _hints(type(event))
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if value is None and f.default is None:
            continue                       # an optional field left out
        if not conforms(value, hints[f.name]):
            raise ValueError(f"field {f.name} should be {type_name(hints[f.name])}, got {value!r:.60}")


def _ids(event: ev.Event, names: tuple[str, ...]) -> Iterable[tuple[str, int]]:
    for name in names:
        value = getattr(event, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            yield name, value
        elif isinstance(value, tuple):
            yield from ((name, v) for v in value)
    if isinstance(event, (ev.BlocksFreed, ev.SwappedOut)) and "block_ids" in names:
        yield from (("released", v) for v in event.released)


def check_block_ids(event: ev.Event, num_blocks: int, num_cpu_blocks: int) -> None:
    """ValueError naming the first block id outside the pool (or the CPU pool)."""
    for pool, size, names in (("pool", num_blocks, BLOCK_FIELDS), ("CPU pool", num_cpu_blocks, CPU_BLOCK_FIELDS)):
        for name, block_id in _ids(event, names):
            if not 0 <= block_id < size:
                raise ValueError(f"{name} has block {block_id}, outside the {pool} of {size} blocks")


def check_synced(event: ev.EngineSynced) -> None:
    """The snapshot event: sizes that agree, rows of the right shape, block tables inside the pool."""
    if event.num_blocks < 1 or event.block_size < 1 or event.num_cpu_blocks < 0:
        raise ValueError(f"a pool of {event.num_blocks} blocks of {event.block_size} tokens cannot exist")
    if len(event.ref_counts) != event.num_blocks:
        raise ValueError(f"ref_counts has {len(event.ref_counts)} entries for {event.num_blocks} blocks")
    for row in event.sequences:
        if len(row) < 9 or not isinstance(row[0], str):
            raise ValueError(f"a request row needs at least 9 fields, got {row!r:.80}")
        tables = [(row[SYNCED_TABLE], event.num_blocks, "pool")]
        if len(row) > SYNCED_CPU_TABLE:
            tables.append((row[SYNCED_CPU_TABLE], event.num_cpu_blocks, "CPU pool"))
        for table, size, pool in tables:
            if not conforms(table, tuple[int, ...]) or any(not 0 <= b < size for b in table):
                raise ValueError(f"request {row[0]}'s block table {table!r:.60} is not a list of blocks of the "
                                 f"{pool} ({size} blocks)")
    for row in event.radix:
        if len(row) != 6 or not conforms(row[SYNCED_RADIX_BLOCKS], tuple[int, ...]) or any(
                not 0 <= b < event.num_blocks for b in row[SYNCED_RADIX_BLOCKS]):
            raise ValueError(f"radix node row {row!r:.80} is not (node, parent, text, tokens, blocks, step) "
                             f"with blocks of the pool")


def check_token_constrained(event: ev.TokenConstrained) -> None:
    """Structured output's event: a mask of 0..V tokens of a V-token vocabulary, forced meaning exactly one,
    and the token inside the vocabulary."""
    if event.vocab_size < 1 or not 0 <= event.num_allowed <= event.vocab_size:
        raise ValueError(f"num_allowed {event.num_allowed} is not a count of tokens of a vocabulary of "
                         f"{event.vocab_size}")
    if event.forced != (event.num_allowed == 1):
        raise ValueError(f"forced is {event.forced} but the mask allowed {event.num_allowed} tokens")
    if not 0 <= event.token_id < event.vocab_size:
        raise ValueError(f"token_id {event.token_id} is outside the vocabulary of {event.vocab_size}")


# Checks of one event type's fields beyond their types (the block ids are checked for every event).
FIELD_CHECKS = {ev.TokenConstrained: check_token_constrained}


def check_trace(events: Iterable[ev.Event], path: str | Path = "trace") -> None:
    """ValueError("<path>: event N (Type): ...") for the first event a viewer could not draw."""
    num_blocks = num_cpu_blocks = None
    for n, event in enumerate(events, start=1):
        try:
            check_types(event)
            if isinstance(event, ev.EngineSynced):
                check_synced(event)
                num_blocks, num_cpu_blocks = event.num_blocks, event.num_cpu_blocks
            elif num_blocks is None:
                raise ValueError("the trace must start with EngineSynced (the engine's state)")
            else:
                check_block_ids(event, num_blocks, num_cpu_blocks)
                if type(event) in FIELD_CHECKS:
                    FIELD_CHECKS[type(event)](event)
        except ValueError as exc:
            raise ValueError(f"{path}: event {n} ({type(event).__name__}, step {event.step!r}): {exc}") from None
