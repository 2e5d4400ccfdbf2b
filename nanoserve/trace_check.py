"""Checking a trace before anything draws it: one check for every consumer.

A JSONL trace is a file, and files come from anywhere: an older version, a
hand edit, a copy cut short by a full disk. `read_trace` checks that each line
names a known event with the right field *names*; this module checks the rest
that a viewer relies on, so that a bad file gets one sentence naming the line
and the field instead of a traceback from deep inside `fold` or matplotlib:

1. types: every field holds the type its event declares (`tuple[int, ...]` is
   a list of ints in JSON; an `int` is never a bool, a float or a string);
2. values: the closed sets (`Preempted.mode` is "recompute" or "swap") and
   ranges (counts and block ids >= 0, times finite and >= 0, no NaN);
3. order: one EngineSynced, first; step numbers never go back; a step's
   events come between its StepStarted and StepFinished;
4. block ids inside the pool the trace's EngineSynced announced;
5. the pool's books (`PoolBooks`): no ref count below zero, a freed block was
   held, the released blocks are exactly those that reached zero, once each;
6. fields that must agree with each other (`FIELD_CHECKS`: a structured-output
   mask allows between 0 and V tokens, forced meaning exactly one);
7. the fold: the viewers' own `fold` applies every event (an event about a
   sequence the trace never added is refused here, not in a viewer).

    events = load_trace("pressure.jsonl")   # ValueError("pressure.jsonl: line 12 (BlocksFreed, step 3): ...")

`load_trace` is what every consumer opens a trace with: `nanoserve export`,
`tui --replay`, `plot`, `compare --trace` and the what-if comparisons and
figures. A last line cut mid-way is salvaged with a warning (`read_trace`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from nanoserve import events as ev
from nanoserve.fold import fold
from nanoserve.trace import quote

# The largest traces the viewers open (docs/tui.md): past them a trace is refused in one line, before
# anything is drawn (a pool is drawn block by block; every step is folded and kept to step back to).
MAX_EVENTS = 250_000
MAX_BLOCKS = 262_144

# Fields that hold ids of device (GPU/CPU pool) blocks, and of CPU swap blocks.
BLOCK_FIELDS = ("block_ids", "free_queue", "kept", "dropped", "src", "dst", "companion")
CPU_BLOCK_FIELDS = ("cpu_block_ids",)
# EngineSynced.requests rows: index of the status, of the block table and of the CPU block table
SYNCED_STATUS, SYNCED_TABLE, SYNCED_CPU_TABLE = 1, 7, 10
SYNCED_RADIX_BLOCKS = 4    # EngineSynced.radix rows: index of the node's block ids

# Fields with a closed set of values: (event type, field) -> the values.
ENUMS = {
    ("Preempted", "mode"): ("recompute", "swap"),
    ("SequenceFinished", "finish_reason"): ("stop", "length", "abort"),
    ("DraftProposed", "method"): ("ngram", "draft"),
    ("CollectiveOps", "kind"): ("broadcast", "all_reduce", "gather", "gather_object", "send", "recv"),
}
STATUSES = ("waiting", "running", "swapped")          # of a live sequence in EngineSynced
# Int fields that may be -1 ("none"); every other int is >= 0.
MINUS_ONE_OK = {("DraftVerified", "first_rejected"), ("Forked", "seed")}


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


def check_values(event: ev.Event) -> None:
    """ValueError naming the first field outside its set of values or its range."""
    name = type(event).__name__
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        options = ENUMS.get((name, f.name))
        if options is not None and value not in options:
            raise ValueError(f"field {f.name} must be one of {', '.join(options)}, got {value!r:.60}")
        floor = -1 if (name, f.name) in MINUS_ONE_OK else 0
        numbers = value if isinstance(value, tuple) and f.name != "config" else (value,)
        for x in numbers:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            if isinstance(x, float) and math.isnan(x):
                raise ValueError(f"field {f.name} is NaN")
            if f.name == "logprob":        # a sampled token's log-probability: <= 0 (float rounding aside)
                if x > 1e-3:
                    raise ValueError(f"field logprob must be <= 0, got {x}")
            elif not floor <= x < math.inf:
                raise ValueError(f"field {f.name} must be {'>= -1' if floor else '>= 0'} and finite, got {x}")


def _ids(event: ev.Event, names: tuple[str, ...]) -> Iterable[tuple[str, int]]:
    for name in names:
        value = getattr(event, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            yield name, value
        elif isinstance(value, tuple):
            yield from ((name, v) for v in value)
    if isinstance(event, (ev.BlocksFreed, ev.SwappedOut, ev.BlocksLeftWindow)) and "block_ids" in names:
        yield from (("released", v) for v in event.released)


def check_block_ids(event: ev.Event, num_blocks: int, num_cpu_blocks: int) -> None:
    """ValueError naming the first block id outside the pool (or the CPU pool)."""
    for table in getattr(event, "group_block_ids", ()):   # KV cache groups 1.. (-1: left the window)
        if any(not -1 <= b < num_blocks for b in table):
            raise ValueError(f"field group_block_ids has {table!r:.60}, outside the pool of {num_blocks} blocks")
    for pool, size, names in (("pool", num_blocks, BLOCK_FIELDS), ("CPU pool", num_cpu_blocks, CPU_BLOCK_FIELDS)):
        for name, block_id in _ids(event, names):
            if not 0 <= block_id < size:
                raise ValueError(f"field {name} has block {block_id}, outside the {pool} of {size} blocks")


def check_synced(event: ev.EngineSynced) -> None:
    """The snapshot event: sizes that agree, rows of the right shape, block tables inside the pool."""
    if event.num_blocks < 1 or event.block_size < 1:
        raise ValueError(f"field num_blocks/block_size: a pool of {event.num_blocks} blocks of "
                         f"{event.block_size} tokens cannot exist")
    if event.num_blocks > MAX_BLOCKS or event.num_cpu_blocks > MAX_BLOCKS:
        raise ValueError(f"field num_blocks: a pool of {max(event.num_blocks, event.num_cpu_blocks)} blocks; "
                         f"nanoserve's viewers draw pools of at most {MAX_BLOCKS} blocks (MAX_BLOCKS)")
    if len(event.ref_counts) != event.num_blocks:
        raise ValueError(f"field ref_counts has {len(event.ref_counts)} entries for {event.num_blocks} blocks")
    for row in event.sequences:
        if len(row) < 9 or not isinstance(row[0], str):
            raise ValueError(f"field sequences: a row needs at least 9 fields, got {row!r:.80}")
        if row[SYNCED_STATUS] not in STATUSES:
            raise ValueError(f"field sequences: {row[0]}'s status must be one of {', '.join(STATUSES)}, "
                             f"got {row[SYNCED_STATUS]!r:.40}")
        tables = [(row[SYNCED_TABLE], event.num_blocks, "pool")]
        if len(row) > SYNCED_CPU_TABLE:
            tables.append((row[SYNCED_CPU_TABLE], event.num_cpu_blocks, "CPU pool"))
        for table, size, pool in tables:
            if not conforms(table, tuple[int, ...]) or any(not 0 <= b < size for b in table):
                raise ValueError(f"field sequences: {row[0]}'s block table {table!r:.60} is not a list of "
                                 f"blocks of the {pool} ({size} blocks)")
    if event.trace_version > ev.TRACE_VERSION:
        raise ValueError(f"field trace_version: the trace is format {event.trace_version}, newer than this "
                         f"nanoserve's {ev.TRACE_VERSION}: upgrade nanoserve to read it")
    _check_groups(event)
    for row in event.radix:
        if len(row) != 6 or not conforms(row[SYNCED_RADIX_BLOCKS], tuple[int, ...]) or any(
                not 0 <= b < event.num_blocks for b in row[SYNCED_RADIX_BLOCKS]):
            raise ValueError(f"field radix: row {row!r:.80} is not (node, parent, text, tokens, blocks, step) "
                             f"with blocks of the pool")


def _check_groups(event: ev.EngineSynced) -> None:
    """KV cache groups (trace format 2): tables of known sequences, blocks of the pool (-1: left the window)."""
    live = {row[0] for row in event.sequences}
    for row in event.group_tables:
        if len(row) != 3 or row[0] not in live or not all(
                conforms(t, tuple[int, ...]) and all(-1 <= b < n for b in t)
                for tables, n in ((row[1], event.num_blocks), (row[2], event.num_cpu_blocks)) for t in tables):
            raise ValueError(f"field group_tables: row {row!r:.80} is not (sequence, tables, CPU tables) of a "
                             f"live sequence with blocks of the pools")
    for row in event.companions:
        if len(row) != 2 or not conforms(row[1], tuple[int, ...]) or any(
                not 0 <= b < event.num_blocks for b in (row[0], *row[1])):
            raise ValueError(f"field companions: row {row!r:.80} is not (block, blocks of groups 1..) of the pool")


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


class PoolBooks:
    """The device pool's ref counts and free blocks, kept from the events the way `block_pool.py`
    keeps them: a block is taken (one more holder; a free one leaves the free queue) or dropped
    (one holder fewer, never below zero), and the blocks that reach zero are released, each once."""

    def __init__(self, synced: ev.EngineSynced) -> None:
        self.refs = list(synced.ref_counts)
        negative = next((b for b, r in enumerate(self.refs) if r < 0), None)
        if negative is not None:
            raise ValueError(f"field ref_counts: block {negative} has {self.refs[negative]} holders")
        if len(set(synced.free_queue)) != len(synced.free_queue):
            raise ValueError("field free_queue lists a block twice")
        self.free = set(synced.free_queue)
        zero = {b for b, r in enumerate(self.refs) if r == 0}
        if self.free != zero:
            odd = sorted(self.free ^ zero)[0]
            raise ValueError(f"field free_queue: block {odd} has {self.refs[odd]} holders but is "
                             f"{'' if odd in self.free else 'not '}in the free queue")
        holders = Counter(b for row in synced.sequences for b in row[SYNCED_TABLE])
        holders.update(b for row in synced.radix for b in row[SYNCED_RADIX_BLOCKS])
        holders.update(b for _, tables, _ in synced.group_tables for t in tables for b in t if b >= 0)
        holders.update(b for _, companions in synced.companions for b in companions)   # (KV cache groups)
        wrong = next((b for b, r in enumerate(self.refs) if r != holders[b]), None)
        if wrong is not None:
            raise ValueError(f"field ref_counts: block {wrong} has {self.refs[wrong]} holders, but "
                             f"{holders[wrong]} block tables and tree nodes hold it")

    def take(self, field: str, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.free.discard(b)
            self.refs[b] += 1

    def drop(self, field: str, blocks: Sequence[int]) -> None:
        for b, times in Counter(blocks).items():
            if self.refs[b] < times:
                raise ValueError(f"field {field}: block {b} is dropped {times} time(s) but has "
                                 f"{self.refs[b]} holder(s)")
            self.refs[b] -= times

    def release(self, field: str, blocks: Sequence[int], dropped: Iterable[int]) -> None:
        """After `drop`: `blocks` go to the free queue; they must be exactly the dropped ones at zero."""
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"field {field} lists a block twice: {list(blocks)!r:.60}")
        at_zero = {b for b in dropped if self.refs[b] == 0}
        if set(blocks) != at_zero:
            b = sorted(set(blocks) ^ at_zero)[0]
            raise ValueError(f"field {field}: block {b} has {self.refs[b]} holder(s) left but is "
                             f"{'' if b in blocks else 'not '}released")
        self.free.update(blocks)

    def apply(self, e: ev.Event) -> None:
        if isinstance(e, (ev.BlocksAllocated, ev.PrefixMatched, ev.Forked, ev.SwappedIn, ev.RadixInserted)):
            self.take("block_ids", e.block_ids)
            if isinstance(e, ev.PrefixMatched):   # KV cache groups 1..: their shares (-1: none)
                self.take("group_block_ids", [b for t in e.group_block_ids for b in t if b >= 0])
        elif isinstance(e, ev.GroupsForked):
            self.take("group_block_ids", [b for t in e.group_block_ids for b in t if b >= 0])
        elif isinstance(e, ev.GroupsCached):
            self.take("group_block_ids", [b for t in e.group_block_ids for b in t])
        elif isinstance(e, (ev.BlocksFreed, ev.SwappedOut, ev.BlocksLeftWindow)):
            self.drop("block_ids", e.block_ids)
            self.release("released", e.released, e.block_ids)
        elif isinstance(e, ev.RadixEvicted):
            self.drop("block_ids", e.block_ids)
            self.release("block_ids", e.block_ids, e.block_ids)
        elif isinstance(e, ev.BlockDeduplicated):
            self.take("kept", [e.kept])
            self.drop("dropped", [e.dropped])
            self.release("released", [e.dropped] if e.released else [], [e.dropped])
        elif isinstance(e, ev.CompanionEvicted):
            self.drop("companion", [e.companion])
            self.release("released", [e.companion] if e.released else [], [e.companion])
        elif isinstance(e, ev.CowCopied):
            self.drop("src", [e.src])
            if self.refs[e.src] == 0:
                raise ValueError(f"field src: block {e.src} was not shared (copy-on-write needs a second holder)")
            self.take("dst", [e.dst])


class _Order:
    """Step numbers: one EngineSynced first, StepStarted numbers increasing, events inside their step."""

    def __init__(self, synced: ev.EngineSynced) -> None:
        self.step, self.open = synced.step, False

    def apply(self, e: ev.Event) -> None:
        if isinstance(e, ev.EngineSynced):
            raise ValueError("a second EngineSynced: a trace holds one run, synced once at its start")
        if isinstance(e, ev.StepStarted):
            if self.open or e.step <= self.step:
                raise ValueError(f"field step: step {e.step} starts after step {self.step}"
                                 f"{' (still open)' if self.open else ''}; steps run in order")
            self.step, self.open = e.step, True
        elif e.step != self.step:
            raise ValueError(f"field step is {e.step}, inside step {self.step}: events come in step order")
        elif isinstance(e, ev.StepFinished):
            if not self.open:
                raise ValueError(f"StepFinished for step {e.step}, which did not start")
            self.open = False


def check_trace(events: Iterable[ev.Event], path: str | Path = "trace", lines: Sequence[int] | None = None) -> None:
    """ValueError("<path>: line N (Type, step S): ...") for the first event nothing could draw.
    `lines`: each event's line in the file (default: "event N", counted from 1)."""
    books = order = state = None
    for n, event in enumerate(events):
        try:
            check_types(event)
            if isinstance(event, ev.EngineSynced) and order is None:
                check_synced(event)
                check_values(event)
                books, order = PoolBooks(event), _Order(event)
            elif order is None:
                raise ValueError("the trace must start with EngineSynced (the engine's state)")
            else:
                order.apply(event)
                check_block_ids(event, len(books.refs), state.num_cpu_blocks)
                check_values(event)
                if type(event) in FIELD_CHECKS:
                    FIELD_CHECKS[type(event)](event)
                books.apply(event)
            state = fold(state, event)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, AssertionError) as exc:
            where = f"line {lines[n]}" if lines is not None else f"event {n + 1}"
            text = str(exc) if isinstance(exc, ValueError) else f"the events do not replay ({type(exc).__name__}: {exc})"
            raise ValueError(f"{path}: {where} ({type(event).__name__}, step {quote(repr(event.step), 20)}): "
                             f"{quote(text, 300)}") from None


def count_lines(path: Path) -> int:
    """The file's lines (a last one without its newline counts), read in blocks: no event is parsed."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _check_pool_first(path: Path) -> None:
    """Refuse a pool past MAX_BLOCKS from the first line's JSON alone, before its lists become events
    (a 2,000,000-block EngineSynced takes seconds to convert and check; this takes a parse)."""
    with open(path, "rb") as f:
        try:
            head = json.loads(f.readline())
        except ValueError:
            return                                  # read_trace_lines says what is wrong with it
    blocks = head.get("num_blocks") if isinstance(head, dict) else None
    if isinstance(blocks, int) and blocks > MAX_BLOCKS:
        raise ValueError(f"{path}: line 1 (EngineSynced): field num_blocks: a pool of {blocks} blocks; "
                         f"nanoserve's viewers draw pools of at most {MAX_BLOCKS} blocks (MAX_BLOCKS)")


def load_trace(path: str | Path) -> list[ev.Event]:
    """Read a JSONL trace and check it: what every consumer opens a trace with.
    FileNotFoundError / ValueError with one line naming the file, the line and the field."""
    from nanoserve.trace import read_trace_lines

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path}")
    lines = count_lines(path)
    if lines > MAX_EVENTS:
        raise ValueError(f"{path} has {lines} lines; nanoserve's viewers open traces of at most {MAX_EVENTS} "
                         "events (MAX_EVENTS): cut it with head -n, keeping the first line (EngineSynced)")
    _check_pool_first(path)
    numbered = read_trace_lines(path)
    events = [e for _, e in numbered]
    check_trace(events, path, [n for n, _ in numbered])
    if not events:
        raise ValueError(f"{path} has no events; a trace starts with EngineSynced")
    return events
