"""What a run did, step by step and request by request, measured from its trace.

`measure(events)` folds a trace (`fold.py`, the same view state every viewer
draws) and writes down, after every step, one `StepRow` — the pool split into
free / used / cached / swapped blocks, the tokens computed, and the running
counts of the events a class asks about — and, per request, one `RequestRow`:
when it arrived, its first token, its finish, and what it was doing at each
step (its timeline). Comparisons (`compare.py`) and plots (`plots.py`) read
these rows, never an engine, so they work on a recorded trace without a model.

Times come in two units. Steps are exact and repeat from run to run; seconds
(`StepFinished.duration_s`) are what the machine measured and vary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve import events as ev
from nanoserve.config import current_names
from nanoserve.fold import fold
from nanoserve.view import ViewState

# What a request is doing during a step (its timeline), in the order a legend lists them.
PHASES = ("waiting", "prefill", "decode", "idle", "preempted", "swapped")
COUNTED = {ev.Preempted: "preemptions", ev.SwappedOut: "swaps", ev.CowCopied: "cow_copies"}


@dataclass(frozen=True, slots=True)
class StepRow:
    """The state after one step, and the running totals up to it."""

    step: int
    free: int                      # blocks in the free queue
    used: int                      # held by a request's table (maybe the cache too)
    cached: int                    # held by the prefix cache alone: evictable, reusable by a hit
    swapped: int                   # CPU pool blocks holding swapped-out KV
    prefill_tokens: int            # computed this step
    decode_tokens: int
    duration_s: float
    # running totals
    preemptions: int = 0
    swaps: int = 0                 # swap-outs
    cow_copies: int = 0
    prefix_hit_tokens: int = 0     # prompt tokens whose prefill the cache skipped

    @property
    def in_use(self) -> int:
        """Blocks not free: used plus cached."""
        return self.used + self.cached


@dataclass(slots=True)
class RequestRow:
    """One request (or fork) over the run."""

    request_id: str
    added_step: int                # added after this many steps
    first_token_step: int | None = None
    finish_step: int | None = None
    finish_reason: str | None = None
    token_steps: list[int] = field(default_factory=list)   # the step of each output token
    # structured output: per constrained token, (tokens the mask allowed, forced, the model's top choice masked)
    masks: list[tuple[int, bool, bool]] = field(default_factory=list)
    phases: dict[int, str] = field(default_factory=dict)   # step -> one of PHASES

    @property
    def ttft_steps(self) -> int | None:
        """Steps from arrival to the first token (1: it came in the first step after arrival)."""
        return None if self.first_token_step is None else self.first_token_step - self.added_step


@dataclass(slots=True)
class RunMetrics:
    """Everything measured over one trace."""

    steps: list[StepRow]
    requests: dict[str, RequestRow]
    num_blocks: int
    config: dict                   # the engine's settings, when the trace carries them

    def totals(self) -> dict[str, int]:
        """Whole-run numbers, the rows of a difference table."""
        last = self.steps[-1] if self.steps else None
        return {
            "steps": len(self.steps),
            "peak blocks in use": max((s.in_use for s in self.steps), default=0),
            "tokens computed": sum(s.prefill_tokens + s.decode_tokens for s in self.steps),
            "prefill tokens computed": sum(s.prefill_tokens for s in self.steps),
            "decode tokens computed": sum(s.decode_tokens for s in self.steps),
            "prefix hit tokens": last.prefix_hit_tokens if last else 0,
            "preemptions": last.preemptions if last else 0,
            "swaps": last.swaps if last else 0,
            "CoW copies": last.cow_copies if last else 0,
        }

    def seconds(self, first: int, last: int) -> float:
        """Measured time of steps first..last (inclusive)."""
        return sum(s.duration_s for s in self.steps if first <= s.step <= last)

    def ttft_s(self) -> dict[str, float]:
        """Per request that got a token: seconds from its arrival to its first token."""
        return {r.request_id: self.seconds(r.added_step + 1, r.first_token_step)
                for r in self.requests.values() if r.first_token_step is not None}

    def itl_s(self) -> list[float]:
        """Seconds between consecutive tokens of a request (0 for tokens of the same step: drafts)."""
        gaps = []
        for r in self.requests.values():
            for before, after in zip(r.token_steps, r.token_steps[1:]):
                gaps.append(self.seconds(before + 1, after))
        return gaps


def measure(events) -> RunMetrics:
    """Fold `events` (a trace starting with EngineSynced) and measure every step."""
    state: ViewState | None = None
    rows, requests, counts, config = [], {}, dict.fromkeys(COUNTED.values(), 0), {}
    scheduled: dict[str, bool] = {}          # this step's chunks: request -> is_prefill
    for event in events:
        state = fold(state, event)
        if isinstance(event, ev.EngineSynced):
            config = current_names(dict(event.config))   # a trace recorded before `path` says it by its name
            requests = {rid: RequestRow(rid, event.step) for rid in state.sequences}
        elif isinstance(event, (ev.RequestAdded, ev.Forked)):
            requests[event.seq_id] = RequestRow(event.seq_id, event.step)
        elif isinstance(event, ev.ChunkScheduled):
            scheduled[event.seq_id] = scheduled.get(event.seq_id, False) or event.is_prefill
        elif isinstance(event, ev.TokenConstrained):
            requests[event.seq_id].masks.append((event.num_allowed, event.forced, event.top_masked))
        elif isinstance(event, ev.TokenSampled):
            row = requests[event.seq_id]
            row.token_steps.append(event.step)
            if row.first_token_step is None:
                row.first_token_step = event.step
        elif isinstance(event, ev.SequenceFinished | ev.SequenceAborted):
            row = requests[event.seq_id]
            if row.finish_step is None:
                row.finish_step = event.step
                row.finish_reason = getattr(event, "finish_reason", "abort")
        elif type(event) in COUNTED:
            counts[COUNTED[type(event)]] += 1
        elif isinstance(event, ev.StepFinished):
            rows.append(_step_row(state, event, counts))
            for rid, row in requests.items():
                phase = _phase(state, rid, scheduled)
                if phase is not None and row.finish_step in (None, event.step):
                    row.phases[event.step] = phase
            scheduled = {}
    if state is None:
        raise ValueError("trace must start with EngineSynced")
    return RunMetrics(rows, requests, state.num_blocks, config)


def _step_row(state: ViewState, event: ev.StepFinished, counts: dict) -> StepRow:
    usage = state.kv_usage()                       # the TUI's and /metrics' definitions (kv_usage.py)
    return StepRow(event.step, usage.free, usage.used, usage.cached, state.cpu_blocks_used(),
                   event.num_prefill_tokens, event.num_decode_tokens, event.duration_s,
                   prefix_hit_tokens=state.cache_hit_tokens, **counts)


def _phase(state: ViewState, rid: str, scheduled: dict[str, bool]) -> str | None:
    """What request `rid` did in the step that just ended (None: not in the run at that step)."""
    if rid in scheduled:
        return "prefill" if scheduled[rid] else "decode"
    req = state.sequences.get(rid)
    if req is None or req.status.startswith("finished"):
        return None
    if req.status == "swapped":
        return "swapped"
    if req.status == "waiting":   # waiting with tokens out: preempted, waiting to recompute
        return "preempted" if req.num_output_tokens else "waiting"
    return "idle"                 # running but given no tokens this step (the budget ran out)
