"""Traces: deliver events, record and replay them, fold them into a view.

This module owns, on top of the plain-data events of `events.py`:

* `EventBus`: each published event goes to every subscriber, synchronously,
  in subscription order.
* JSONL record/replay (`JsonlRecorder`, `write_trace`, `read_trace`): one
  event per line with a `"type"` tag; replay gives back equal (`==`) events.
* `fold(state, event) -> ViewState`: rebuilds what every viewer draws (block
  pool, block tables, queues, request progress) from events alone, so the
  TUI, Graphviz and lessons work on a recorded trace without a model.

It leaves deciding to the scheduler and block pool, emitting events to the
engine, and drawing to viz/ and tui/. It imports nothing but `events.py`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.events import (
    EVENT_TYPES, BlocksAllocated, BlocksFreed, ChunkScheduled, EngineSynced, Event, Preempted,
    RequestAborted, RequestAdded, RequestAdmitted, RequestFinished, StepFinished, StepStarted,
    TokenSampled, KVTrimmed,
)

# -- the bus ------------------------------------------------------------------
class EventBus:
    """Synchronous publish/subscribe for engine events.

    A subscriber that raises is not silenced: the exception propagates out of
    `publish` (and so out of `engine.step()`), and later subscribers do not get
    that event. A broken viewer should be loud, not quietly miss events.
    """

    def __init__(self) -> None:
        self._subscribers: dict[int, Callable[[Event], None]] = {}  # by subscription number
        self._next_id = 0

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
            callback(event)

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


def event_from_dict(d: dict) -> Event:
    """Inverse of `event_to_dict`; ValueError on an unknown type or bad fields."""
    if not isinstance(d, dict):
        raise ValueError(f"event must be a JSON object, got {d!r}")
    d = dict(d)
    name = d.pop("type", None)
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown event type {name!r} in {d!r}")
    try:
        return cls(**{k: _tuples(v) for k, v in d.items()})
    except TypeError as e:  # missing or unexpected field names
        raise ValueError(f"bad fields for {name}: {e}") from None


class JsonlRecorder:
    """Writes each event it is called with as one JSON line, flushed at once.

    Use it as a bus subscriber: `with JsonlRecorder(p) as rec: bus.subscribe(rec)`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "w", encoding="utf-8")

    def __call__(self, event: Event) -> None:
        self._file.write(json.dumps(event_to_dict(event), ensure_ascii=False) + "\n")
        self._file.flush()  # a crash mid-run still leaves a readable trace

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_trace(path: str | Path, events: Iterable[Event]) -> None:
    with JsonlRecorder(path) as rec:
        for event in events:
            rec(event)


def read_trace(path: str | Path) -> list[Event]:
    """All events of a JSONL trace; ValueError("path:lineno: ...") on a corrupt line."""
    events = []
    with open(path, encoding="utf-8") as f:  # FileNotFoundError propagates as is
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                events.append(event_from_dict(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}:{lineno}: {e}: {line.strip()[:200]}") from None
    return events


# -- fold: events -> view state -----------------------------------------------

FINISHED_STATUS = {"stop": "finished_stopped", "length": "finished_length", "abort": "finished_aborted"}
HISTORY_LEN = 1000  # finished steps kept in ViewState.history


@dataclass(slots=True)
class RequestView:
    """One request as a viewer sees it."""

    request_id: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    status: str = "waiting"           # "waiting" | "running" | "finished_" + stopped/length/aborted
    output_text: str = ""
    num_output_tokens: int = 0
    num_computed_tokens: int = 0      # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished


@dataclass(slots=True)
class ViewState:
    """Everything a viewer draws, rebuilt from events by `fold`."""

    step: int
    model: str
    num_blocks: int
    block_size: int
    ref_counts: list[int]             # per physical block
    free_queue: list[int]             # block ids, head (next allocated) first
    requests: dict[str, RequestView] = field(default_factory=dict)  # in arrival order, finished kept
    waiting: list[str] = field(default_factory=list)    # request ids, next admitted first
    running: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)   # in finishing order
    touched_blocks: set[int] = field(default_factory=set)  # allocated or freed this step
    last_step: StepFinished | None = None
    # (step, num_prefill_tokens, num_decode_tokens, num_free_blocks, duration_s), last HISTORY_LEN steps
    history: list[tuple[int, int, int, int, float]] = field(default_factory=list)

    def block_owners(self) -> dict[int, list[str]]:
        """Block id -> ids of the requests whose block tables hold it (held blocks only)."""
        owners: dict[int, list[str]] = {}
        for rid, req in self.requests.items():
            for block_id in req.block_table:
                owners.setdefault(block_id, []).append(rid)
        return dict(sorted(owners.items()))


def synced_event(snapshot: dict) -> EngineSynced:
    """`engine.snapshot()` as an EngineSynced event, requests in queue order (running, then waiting)."""
    pool = snapshot["pool"]
    by_id = {r["request_id"]: r for r in snapshot["requests"]}
    order = list(snapshot["running"]) + list(snapshot["waiting"])
    requests = tuple(
        (r["request_id"], r["status"], r["prompt"], r["num_prompt_tokens"], r["output_text"],
         r["num_output_tokens"], r["num_computed_tokens"], tuple(r["block_table"]), r["max_tokens"])
        for r in (by_id[rid] for rid in order)
    )
    return EngineSynced(snapshot["step"], snapshot["model"], pool["num_blocks"], pool["block_size"],
                        tuple(pool["ref_counts"]), tuple(pool["free_queue"]), requests)


def _synced_state(e: EngineSynced) -> ViewState:
    state = ViewState(e.step, e.model, e.num_blocks, e.block_size, list(e.ref_counts), list(e.free_queue))
    for rid, status, prompt, n_prompt, text, n_out, n_computed, table, max_tokens in e.requests:
        state.requests[rid] = RequestView(rid, prompt, n_prompt, max_tokens, status, text, n_out, n_computed,
                                          list(table))
        if status in ("running", "waiting"):
            (state.running if status == "running" else state.waiting).append(rid)
    return state


def _finish(state: ViewState, req: RequestView, reason: str) -> None:
    if reason not in FINISHED_STATUS:
        raise ValueError(f"unknown finish reason {reason!r} for request {req.request_id!r}")
    if req.request_id in state.finished:
        return  # RequestAborted then RequestFinished("abort"): count it once
    req.status, req.finish_reason = FINISHED_STATUS[reason], reason
    for queue in (state.waiting, state.running):
        if req.request_id in queue:
            queue.remove(req.request_id)
    state.finished.append(req.request_id)


def fold(state: ViewState | None, event: Event) -> ViewState:
    """Apply one event to `state` (mutated and returned); `EngineSynced` starts afresh.

    Block events mirror `block_pool.py`: allocating unlinks a block from
    wherever it sits in the free queue; freeing drops one holder per block,
    then appends `released` to the tail in the event's order. A holder that
    is not a known request (e.g. a cache lock) changes the pool, no table.
    """
    if isinstance(event, EngineSynced):
        return _synced_state(event)
    if state is None:
        raise ValueError("trace must start with EngineSynced")
    state.step = max(state.step, event.step)
    rid = getattr(event, "request_id", None)
    req = state.requests.get(rid)

    if isinstance(event, BlocksAllocated):
        for block_id in event.block_ids:
            if state.ref_counts[block_id] == 0:
                state.free_queue.remove(block_id)  # a fresh block (head) or a revived cached one
            state.ref_counts[block_id] += 1        # 0 -> 1, or one more sharer
        if req is not None:
            req.block_table.extend(event.block_ids)
        state.touched_blocks.update(event.block_ids)
    elif isinstance(event, BlocksFreed):
        for block_id in event.block_ids:
            state.ref_counts[block_id] -= 1
            if req is not None and block_id in req.block_table:
                req.block_table.remove(block_id)
        state.free_queue.extend(event.released)
        state.touched_blocks.update(event.block_ids)
    elif isinstance(event, StepStarted):
        state.step = event.step
        state.touched_blocks.clear()
    elif isinstance(event, StepFinished):
        state.last_step = event
        state.history.append((event.step, event.num_prefill_tokens, event.num_decode_tokens,
                              event.num_free_blocks, event.duration_s))
        del state.history[:-HISTORY_LEN]
    elif isinstance(event, RequestAdded):
        state.requests[rid] = RequestView(rid, event.prompt, event.num_prompt_tokens, event.max_tokens)
        state.waiting.append(rid)
    elif req is None:  # every other event is about a request we must know
        raise ValueError(f"{type(event).__name__} for unknown request {rid!r}")
    elif isinstance(event, RequestAdmitted):
        state.waiting.remove(rid)
        state.running.append(rid)
        req.status = "running"
    elif isinstance(event, ChunkScheduled):
        req.num_computed_tokens = event.start + event.num_tokens
    elif isinstance(event, Preempted):
        state.running.remove(rid)
        state.waiting.insert(0, rid)  # a preempted request is admitted first again
        req.status, req.num_computed_tokens = "waiting", 0
    elif isinstance(event, KVTrimmed):
        req.num_computed_tokens = event.num_computed_tokens   # rejected drafts' KV is gone
    elif isinstance(event, TokenSampled):
        req.num_output_tokens += 1
        req.output_text += event.text
    elif isinstance(event, RequestFinished):
        _finish(state, req, event.finish_reason)
    elif isinstance(event, RequestAborted):
        _finish(state, req, "abort")
    return state


def fold_all(events: Iterable[Event]) -> ViewState:
    """Fold a whole trace (which must start with EngineSynced) into one view state."""
    state = None
    for event in events:
        state = fold(state, event)
    if state is None:
        raise ValueError("trace must start with EngineSynced")
    return state
