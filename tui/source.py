"""Where the TUI's events come from: a live engine, or a recorded trace.

Both sources hand the app the same thing, a `Frame`: the `ViewState` that
`fold()` built from every event so far, plus the events of the latest step
(for the log). The app draws only frames, never the engine, which is why a
replayed trace looks exactly like the live run that recorded it.

* `LiveSource` (live_source.py) runs an `LLMEngine` (inside a what-if `Run`, nanoserve/whatif/run.py,
  that feeds the scenario's arrivals and keeps the command log) on a Textual
  worker thread. The UI never touches the engine: it puts commands (step,
  add, abort, fork, restart, back, branch) on a queue, the worker executes them one at a time and
  sends each command's events back with `call_from_thread`, where they are
  folded on the UI thread. A command that fails is a notice, and the engine
  in use stays (a failed restart keeps the old one on screen); a fold that
  fails is a notice too, and the view restarts from a fresh `EngineSynced`.
  Stepping back (`b`) rewinds: the run's command log is replayed into a fresh
  engine on the same loaded model, one step short; a branch does the same with
  other settings. Either way the view is rebuilt from the new run's whole history.
* `ReplaySource` reads a JSONL trace, splits it into steps, and folds up to
  step N; every frame is cached, so stepping back is instant.

A command a source cannot do (abort in a replay, a branch of a trace) raises
`Unsupported` with a sentence for the user; the app shows it as a notice.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from textual.app import App
from textual.message import Message

from nanoserve.events import DraftVerified, Event, StepFinished, StepStarted
from nanoserve.trace import ViewState, fold, fold_all
from nanoserve.trace_check import MAX_EVENTS, count_lines, load_trace

# The app's actions that depend on the source (`Source.controls` says which it has): the key bar shows
# only those, and a hidden key says why it does not apply.
CONTROLS = frozenset({"step", "toggle_run", "speed", "back", "add", "abort", "fork", "presets", "branch"})


class Unsupported(Exception):
    """A control that does not apply here; the message says why, for the user."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One picture's worth of data: everything the panels draw."""

    state: ViewState
    events: tuple[Event, ...]              # the latest step's events (or a command's, e.g. an abort)
    acceptance: tuple[float, ...] = ()     # accepted / drafted, per step that verified drafts
    at_end: bool = False                   # nothing more to step: the trace ended, or no work is left
    last_step: int | None = None           # the trace's last step (replay); None when live


class SourceStatus(Message):
    """The source changed state: "loading", "ready" or "error" (with a text for the user)."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__()
        self.kind, self.text = kind, text


class FirstLoadProgress(Message):
    """The model's one-time GGUF conversion moved on (a `nanoserve.models.first_load.Conversion`)."""

    def __init__(self, conversion) -> None:
        super().__init__()
        self.conversion = conversion


class FrameReady(Message):
    """A new frame to draw."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame


class LabStepFailed(Message):
    """`--lab`: a step failed in the student's component. The run pauses on it (the frame shows the pool,
    tables and queue as the failure left them); `text` says where and what, `hint` what to look at."""

    def __init__(self, text: str, hint: str) -> None:
        super().__init__()
        self.text, self.hint = text, hint


def acceptance_rate(events: Sequence[Event]) -> float | None:
    """Accepted / drafted over one step's DraftVerified events; None when nothing was drafted."""
    drafted = accepted = 0
    for e in events:
        if isinstance(e, DraftVerified):
            drafted, accepted = drafted + e.num_drafted, accepted + e.num_accepted
    return accepted / drafted if drafted else None


def split_steps(events: Sequence[Event]) -> list[list[Event]]:
    """Group a trace by step: [prelude, step 1, step 2, ...].

    The prelude is everything before the first StepStarted (EngineSynced, the
    first arrivals). A step runs to its StepFinished; requests added between
    steps open the next group, as they do in a live run (a `ScenarioRunner`
    adds arrivals right before it steps).
    """
    groups: list[list[Event]] = []
    current: list[Event] = []
    for event in events:
        if isinstance(event, StepStarted) and not groups:
            groups.append(current)
            current = []
        current.append(event)
        if isinstance(event, StepFinished):
            groups.append(current)
            current = []
    if current or not groups:
        groups.append(current)
    return groups


class Source:
    """What the app asks of a source. Results arrive as FrameReady / SourceStatus messages."""

    mode: ClassVar[str]
    controls: ClassVar[frozenset[str]]     # the app's actions (of CONTROLS) this source can do
    description: str = ""                  # e.g. "memory-pressure on tiny-llama"
    busy: str | None = None                # e.g. "rewinding to step 30": a command is replaying the run
    chat_template: str | None = None       # the model's name when its tokenizer has a chat template (live)

    def attach(self, app: App) -> None:
        """Start: post the first frame (and status) to `app`."""
        raise NotImplementedError

    def step(self, *, if_idle: bool = False) -> None:
        """One step forward. `if_idle`: skip when a step is still being computed (the run timer)."""
        raise NotImplementedError

    def back(self) -> None:
        raise Unsupported("step back works in replay; a live engine only goes forward")

    def add_request(self, request_id: str, prompt: str, params: dict) -> None:
        raise Unsupported("adding a request needs a live engine; this is a replay of a recorded trace")

    def abort(self, request_id: str) -> None:
        raise Unsupported("abort needs a live engine; this is a replay of a recorded trace")

    def fork(self, request_id: str) -> None:
        raise Unsupported("fork needs a live engine; this is a replay of a recorded trace")

    def branch(self, changes: dict) -> None:
        raise Unsupported("a branch needs a live engine: a recorded trace has no weights to run "
                          "(start one with p, or `nanoserve tui --scenario NAME`)")

    @property
    def settings(self) -> dict:
        """The engine settings a branch starts from (empty: this source cannot branch)."""
        return {}

    @property
    def changes(self) -> dict:
        """The settings a branch changed from the run's start (empty: none), for the status line."""
        return {}

    def close(self) -> None:
        """Stop whatever the source runs (the live worker)."""


CHECKPOINT = 64    # ReplaySource keeps every 64th frame: going back folds at most 63 steps again
RECENT = 8         # ... and the last frames asked for (the app compares a frame by identity)


class ReplaySource(Source):
    """Frames from a recorded trace; step N is the fold of steps 0..N."""

    mode = "replay"
    controls = frozenset({"step", "toggle_run", "speed", "back", "presets"})

    def __init__(self, events: Sequence[Event], name: str = "trace") -> None:
        fold_all(events)                              # a trace that does not fold fails here, up front
        self.groups = split_steps(events)
        self.description = name
        self.final_step = max(e.step for e in events)   # shown as "step 12/37"
        self.position = 0                             # index into groups
        self._frames: dict[int, Frame] = {}           # kept frames: checkpoints and the RECENT last asked for
        self._recent: list[int] = []
        self._app: App | None = None

    @classmethod
    def from_path(cls, path: str | Path) -> ReplaySource:
        """Read and check a trace; FileNotFoundError / ValueError with a clear message."""
        path = Path(path)
        return cls(load_trace(path), name=path.name)

    @property
    def last(self) -> int:
        return len(self.groups) - 1

    def frame(self, index: int) -> Frame:
        """The frame after group `index` (the same object each time while it is kept), folded forward from
        the nearest kept frame before it: every CHECKPOINT-th frame is kept, and the RECENT last asked for,
        so a long trace costs a state per CHECKPOINT steps, not one per step."""
        frame = self._frames.get(index)
        if frame is not None:
            return frame
        base = max((k for k in self._frames if k < index), default=None)
        state = copy.deepcopy(self._frames[base].state) if base is not None else None   # kept frames never change
        acceptance = self._frames[base].acceptance if base is not None else ()
        for k in range(0 if base is None else base + 1, index + 1):
            for event in self.groups[k]:
                state = fold(state, event)
            rate = acceptance_rate(self.groups[k])
            acceptance += () if rate is None else (rate,)
            if k % CHECKPOINT == 0 or k == index:
                frame = Frame(state, tuple(self.groups[k]), acceptance, k == self.last, self.final_step)
                self._frames[k] = frame
                if k != index:
                    state = copy.deepcopy(state)
        self._recent.append(index)
        if len(self._recent) > RECENT:
            old = self._recent.pop(0)
            if old % CHECKPOINT and old not in self._recent:
                self._frames.pop(old, None)
        return frame

    def steps(self) -> list[int]:
        """The engine step each group's frame shows (its state's step), without folding: a running max."""
        steps, step = [], 0
        for group in self.groups:
            step = max([step, *(e.step for e in group)])
            steps.append(step)
        return steps

    def attach(self, app: App) -> None:
        self._app = app
        app.post_message(SourceStatus("ready", f"replaying {self.description}"))
        self.goto(self.position)

    def goto(self, index: int) -> None:
        self.position = max(0, min(index, self.last))
        if self._app is not None:
            self._app.post_message(FrameReady(self.frame(self.position)))

    def step(self, *, if_idle: bool = False) -> None:
        if self.position >= self.last:
            raise Unsupported(f"end of the trace (step {self.frame(self.last).state.step})")
        self.goto(self.position + 1)

    def back(self) -> None:
        if self.position == 0:
            raise Unsupported("already at the start of the trace")
        self.goto(self.position - 1)


LONG_TRACE = 20_000    # events: a trace this long takes seconds to read, and a line says so first


def replay_source(path: str | Path) -> ReplaySource:
    """A checked trace's source: ValueError naming the file and the first event a viewer could not draw."""
    path = Path(path)
    lines = count_lines(path) if path.is_file() else 0
    if LONG_TRACE <= lines <= MAX_EVENTS:     # (seconds of reading and checking: say so before the screen)
        print(f"nanoserve: reading {path} ({lines} events) …", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    events = load_trace(path)                 # ValueError("path: line N (Type, step S): field ...")
    try:
        source = ReplaySource(events, name=path.name)
    except (KeyError, IndexError, TypeError, AttributeError, AssertionError) as exc:   # folds inconsistently
        raise ValueError(f"{path}: the events do not replay ({type(exc).__name__}: {exc})") from None
    if LONG_TRACE <= lines:
        print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return source
