"""Traces: deliver events, record and replay them, fold them into a view.

This module owns, on top of the plain-data events of `events.py`:

* `EventBus`: each published event goes to every subscriber, synchronously,
  in subscription order.
* JSONL record/replay (`JsonlRecorder`, `write_trace`, `read_trace`): one
  event per line with a `"type"` tag; replay gives back equal (`==`) events.
* `fold(state, event) -> ViewState` and `synced_event(snapshot)` are
  re-exported from `fold.py` (the view state's types live in `view.py`):
  they rebuild what every viewer draws from events alone, so the TUI,
  Graphviz and lessons work on a recorded trace without a model.

It leaves deciding to the scheduler and block pool, emitting events to the
engine, and drawing to viz/ and tui/.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from nanoserve.events import EVENT_TYPES, Event
from nanoserve.fold import fold, fold_all, synced_event
from nanoserve.view import FINISHED_STATUS, HISTORY_LEN, ROOT, RadixNodeView, SequenceView, ViewState

__all__ = [
    "EventBus", "JsonlRecorder", "TraceWarning", "event_to_dict", "event_from_dict", "write_trace", "read_trace",
    "read_trace_lines", "quote",
    # the view state and its fold, here too so `from nanoserve.trace import fold, ViewState` keeps working
    "fold", "fold_all", "synced_event", "ViewState", "SequenceView", "RadixNodeView", "FINISHED_STATUS",
    "HISTORY_LEN", "ROOT",
]

# -- the bus ------------------------------------------------------------------
class EventBus:
    """Synchronous publish/subscribe for engine events.

    A subscriber that raises is not silenced. By default the exception
    propagates out of `publish`, and later subscribers do not get that event.
    With `hold_errors=True` (the engine's bus) `publish` never raises: every
    subscriber gets every event, and the errors wait in `held` until the
    publisher is at a point where raising cannot leave it half way through a
    change (`raise_held`). A broken viewer should be loud, not quietly miss
    events, and not stop the engine mid-step either.
    """

    def __init__(self, hold_errors: bool = False) -> None:
        self._subscribers: dict[int, Callable[[Event], None]] = {}  # by subscription number
        self._next_id = 0
        self.hold_errors = hold_errors
        self.held: list[tuple[Callable, Event, Exception]] = []     # (subscriber, event, what it raised)

    @property
    def active(self) -> bool:
        """True when someone listens, so the engine may skip building events otherwise."""
        return bool(self._subscribers)

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Add `callback`; return a function that removes it again (safe to call twice)."""
        key, self._next_id = self._next_id, self._next_id + 1
        self._subscribers[key] = callback

        def unsubscribe() -> None:
            self._subscribers.pop(key, None)

        return unsubscribe

    def publish(self, event: Event) -> None:
        # iterate over a copy: a subscriber may unsubscribe itself while called
        for callback in list(self._subscribers.values()):
            if not self.hold_errors:
                callback(event)
                continue
            try:
                callback(event)
            except Exception as exc:   # noqa: BLE001 -- held, raised by raise_held()
                self.held.append((callback, event, exc))

    def raise_held(self, wrap: Callable[[str], Exception]) -> None:
        """Raise `wrap(description)` from the first held error, if any, and forget them all."""
        if not self.held:
            return
        held, self.held = self.held, []
        text = "; ".join(f"subscriber {getattr(cb, '__qualname__', cb)} raised {type(exc).__name__}: {exc} "
                         f"on {event}" for cb, event, exc in held[:3]) + (" ..." if len(held) > 3 else "")
        raise wrap(text) from held[0][2]

    def publish_many(self, events: Iterable[Event]) -> None:
        for event in events:
            self.publish(event)


# -- JSONL record / replay ----------------------------------------------------
def _lists(value):
    """Tuples (nested too) to lists, for JSON."""
    return [_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuples(value):
    """Lists (nested too) back to tuples: events hold only tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def event_to_dict(event: Event) -> dict:
    """`{"type": "TokenSampled", "step": 3, ...}` with tuples turned into lists."""
    fields = {f.name: _lists(getattr(event, f.name)) for f in dataclasses.fields(event)}
    return {"type": type(event).__name__, **fields}


# Traces recorded before events said "sequence" for what is one (a request's forks and beams
# are sequences too) still read: these types were renamed, and their `request_id` field, like
# every sequence-level event's and EngineSynced's `requests`, is read as `seq_id` (`sequences`).
_RENAMED_TYPES = {"RequestAdmitted": "SequenceAdmitted", "RequestFinished": "SequenceFinished",
                  "RequestAborted": "SequenceAborted"}


def quote(text: str | bytes, limit: int = 120) -> str:
    """`text` safe to print in one line of an error: bytes that are not UTF-8, control characters and
    terminal escapes written as escapes (\\x1b, \\xff, \\u2028), cut to about `limit` characters."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    text = text.strip()
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:limit])
    return shown[:limit] + ("..." if len(shown) > limit or len(text) > limit else "")


def event_from_dict(d: dict) -> Event:
    """Inverse of `event_to_dict`; ValueError on an unknown type or bad fields."""
    if not isinstance(d, dict):
        raise ValueError(f"event must be a JSON object, got {type(d).__name__}")
    d = dict(d)
    name = d.pop("type", None)
    name = _RENAMED_TYPES.get(name, name) if isinstance(name, str) else name
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is not None and "request_id" in d and "seq_id" in {f.name for f in dataclasses.fields(cls)}:
        d["seq_id"] = d.pop("request_id")      # a trace from before the rename (see _RENAMED_TYPES)
    if cls is EVENT_TYPES["EngineSynced"] and "requests" in d:
        d["sequences"] = d.pop("requests")
    if cls is None:
        raise ValueError(f"unknown event type {quote(repr(name), 60)}")
    try:
        return cls(**{k: _tuples(v) for k, v in d.items()})
    except TypeError as e:  # missing or unexpected field names
        raise ValueError(f"bad fields for {name}: {quote(str(e), 160)}") from None


class JsonlRecorder:
    """Writes each event it is called with as one JSON line, straight to the file.

    Use it as a bus subscriber: `with JsonlRecorder(p) as rec: bus.subscribe(rec)`.
    Each line goes out whole or not at all: when a write fails (a full disk), the
    file is cut back to the last whole line, the recorder stops (`error` says why;
    later events are not written) and the OSError is raised once. So a trace
    always ends at a line boundary, and a crash mid-run leaves a readable trace.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb", buffering=0)   # unbuffered: a line is on disk when the call returns
        self.lines = 0                 # whole lines written
        self._size = 0                 # bytes in those lines
        self.error: str | None = None  # why recording stopped, if it did

    def __call__(self, event: Event) -> None:
        if self.error is not None or self._file.closed:
            return
        d = event_to_dict(event)
        try:
            line = json.dumps(d, ensure_ascii=False).encode("utf-8") + b"\n"
        except UnicodeEncodeError:     # text that is not valid Unicode: JSON escapes it, ASCII only
            line = json.dumps(d).encode("ascii") + b"\n"
        try:
            view = memoryview(line)
            while view:
                view = view[self._file.write(view):]
        except OSError as exc:
            self.error = f"{exc.strerror or exc} after {self.lines} events"
            try:                        # give back the part of the line that made it to the disk
                self._file.truncate(self._size)
            except OSError:
                pass
            self._file.close()
            raise OSError(exc.errno, f"recording to {self.path} stopped: {self.error} "
                                     f"(the trace keeps them, whole)") from None
        self.lines += 1
        self._size += len(line)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TraceWarning(UserWarning):
    """A trace was read with a repair: its cut last line was left out."""


def write_trace(path: str | Path, events: Iterable[Event]) -> None:
    with JsonlRecorder(path) as rec:
        for event in events:
            rec(event)


def read_trace(path: str | Path) -> list[Event]:
    """All events of a JSONL trace; ValueError("path:lineno: ...") on a corrupt line.

    A last line cut mid-way (no newline at its end, and not JSON: a recording that
    stopped on a full disk or a crash) is left out with a `TraceWarning`."""
    return [event for _, event in read_trace_lines(path)]


def read_trace_lines(path: str | Path) -> list[tuple[int, Event]]:
    """(line number, event) for every event of a trace: `read_trace` with the line numbers."""
    with open(path, "rb") as f:      # FileNotFoundError propagates as is
        lines = f.read().split(b"\n")
    cut = lines.pop() if lines[-1] else None   # a last line without its newline
    numbered = list(enumerate(lines, start=1)) + ([(len(lines) + 1, cut)] if cut is not None else [])
    events = []
    for lineno, raw in numbered:
        try:
            text = raw.decode("utf-8")
            if not text.strip():
                continue
            d = json.loads(text)
        except ValueError as e:      # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
            if raw is cut:
                warnings.warn(f"{path}: line {lineno} is cut short (the recording stopped mid-line); "
                              f"reading the {len(events)} events before it", TraceWarning, stacklevel=3)
                break
            why = "not UTF-8" if isinstance(e, UnicodeDecodeError) else f"not JSON ({e})"
            raise ValueError(f"{path}:{lineno}: {why}: {quote(raw)}") from None
        try:
            events.append((lineno, event_from_dict(d)))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}: {quote(text)}") from None
    return events
