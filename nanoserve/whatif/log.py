"""The command log: what was done to an engine, and when, read back from its events.

A run is reproducible from three things: its settings (`EngineConfig`, the
seed among them), its workload and the *commands* given to it between steps:
which request was added, aborted or forked after which step. This module
owns `Command` (one of them) and `CommandLog`, a subscriber that writes the
log down from the engine's own events, so any engine can be recorded, and a
JSONL trace is a log too:

    log = CommandLog()
    engine.subscribe(log)           # before the first request
    ...                             # add_request / step / fork / abort_request as usual
    log.commands                    # [Command(ADD, step=0, 'r1', ...), Command(FORK, step=3, 'r1', ...)]

Events carry what a replay needs: `RequestAdded` the prompt as given (text,
or token ids), the sampling parameters and the seed the request actually got
(its own, or one drawn from the engine's RNG); `Forked` the seed of the new
sequence. A user's fork and abort are told apart from the engine's own (n > 1,
beam search, a failed request) by *when* they happen: between steps, not
inside one.

Replaying the log (`run.py`) gives every request the seed it got the first
time, so sampled requests repeat exactly even when a branch with other
settings would have drawn seeds in another order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from nanoserve import events as ev
from nanoserve.sampling_params import SamplingParams, from_pairs, to_pairs


class CommandKind(Enum):
    ADD = "add"
    ABORT = "abort"
    FORK = "fork"


@dataclass(frozen=True, slots=True)
class Command:
    """One call made on an engine between steps."""

    kind: CommandKind
    step: int                          # made after this many steps (0: before the first)
    request_id: str                    # add: the new request; abort: what was aborted; fork: the parent
    prompt: str | tuple[int, ...] = ""   # add: text, or token ids
    params: tuple[tuple[str, object], ...] = ()   # add: SamplingParams as (field, value) pairs, seed included
    priority: int = 0                  # add
    seed: int | None = None            # fork: the new sequence's seed (add: inside params)
    child_id: str = ""                 # fork: the id the new sequence got

    def __post_init__(self) -> None:
        if not isinstance(self.kind, CommandKind):
            raise ValueError(f"kind must be a CommandKind, got {self.kind!r}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.kind is CommandKind.ADD and not self.prompt:
            raise ValueError(f"adding {self.request_id!r} needs a prompt")

    @classmethod
    def add(cls, step: int, request_id: str, prompt, params: SamplingParams | dict | None = None,
            priority: int = 0) -> Command:
        """An add command from a call's arguments (params as SamplingParams or its fields)."""
        if isinstance(params, dict):
            params = SamplingParams(**params)
        prompt = prompt if isinstance(prompt, str) else tuple(int(t) for t in prompt)
        return cls(CommandKind.ADD, step, request_id, prompt, to_pairs(params or SamplingParams()), priority)

    @property
    def sampling_params(self) -> SamplingParams:
        return from_pairs(self.params)

    def describe(self) -> str:
        """One line for a person: `add r1 (12 tokens, max_tokens 16) after step 0`."""
        if self.kind is CommandKind.ADD:
            what = f"add {self.request_id}"
        elif self.kind is CommandKind.FORK:
            what = f"fork {self.request_id}" + (f" -> {self.child_id}" if self.child_id else "")
        else:
            what = f"abort {self.request_id}"
        return f"{what} after step {self.step}"


class CommandLog:
    """A subscriber that writes down the commands an engine was given, from its events.

    `complete` is False when the log cannot replay the run from its start: it
    began after the engine had run (its first event was a mid-run EngineSynced),
    or the events are too old to hold the sampling parameters and seeds.
    """

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.config: dict = {}             # the engine's settings, from EngineSynced (when it has them)
        self.model: str = ""
        self.complete = True
        self.why_incomplete = ""
        self._in_step = False
        self._started = False

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.EngineSynced):
            if not self._started and (event.step > 0 or event.sequences):
                self._incomplete(f"recording began at step {event.step}, after the engine had work")
            if not self._started:
                self.config, self.model = dict(event.config), event.model
            self._started = True
        elif isinstance(event, ev.StepStarted):
            self._in_step = True
        elif isinstance(event, ev.StepFinished):
            self._in_step = False
        elif self._in_step:
            return                          # inside a step everything is the engine's own doing
        elif isinstance(event, ev.RequestAdded):
            if not event.params:
                self._incomplete("the trace was recorded before events carried sampling parameters and seeds")
            prompt = event.token_ids if event.token_ids else event.prompt
            self.commands.append(Command(CommandKind.ADD, event.step, event.request_id, prompt, event.params,
                                         event.priority))
        elif isinstance(event, ev.Forked):
            if event.seed < 0:
                self._incomplete("the trace was recorded before Forked events carried seeds")
            self.commands.append(Command(CommandKind.FORK, event.step, event.parent_id, seed=event.seed,
                                         child_id=event.seq_id))
        elif isinstance(event, ev.SequenceAborted):
            self.commands.append(Command(CommandKind.ABORT, event.step, event.seq_id))

    def _incomplete(self, why: str) -> None:
        if self.complete:
            self.complete, self.why_incomplete = False, why

    @classmethod
    def from_events(cls, events) -> CommandLog:
        """The log of a recorded trace."""
        log = cls()
        for event in events:
            log(event)
        return log
