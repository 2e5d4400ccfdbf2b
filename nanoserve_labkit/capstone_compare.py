"""What the capstone compares, and whom it blames: one scenario's (or operation's) reports side by side.

Shared by the scenario stage (capstone.py) and the state-machine stage (capstone_fuzz.py): the result of a
stage, equality of two reported values, the first difference in plain words, and the part whose event it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from nanoserve.labs.capstone import Part

# Whose event is it: the part most likely at fault when this event is the first to differ.
OWNER = {
    "BlocksAllocated": "block-pool", "BlocksFreed": "block-pool",
    "PrefixMatched": "radix-cache", "RadixInserted": "radix-cache", "RadixSplit": "radix-cache",
    "RadixLocked": "radix-cache", "RadixEvicted": "radix-cache", "BlockDeduplicated": "radix-cache",
    "Forked": "cow-fork", "CowCopied": "cow-fork",
    "SequenceAdmitted": "scheduler-budget", "ChunkScheduled": "scheduler-budget", "StepStarted": "scheduler-budget",
    "Preempted": "preemption", "SwappedOut": "preemption", "SwappedIn": "preemption",
    "DraftVerified": "rejection-sampling", "KVTrimmed": "rejection-sampling",
    "TokenSampled": "step-commit", "SequenceFinished": "step-commit", "BeamPruned": "step-commit",
    "SequenceAborted": "step-commit", "TokenConstrained": "step-commit", "RequestAdded": "step-commit",
    "StepFinished": "block-pool",
}


@dataclass(slots=True)
class ScenarioResult:
    name: str
    passed: bool
    detail: str = ""               # the first difference, or what went wrong
    part: str = ""                 # the part most likely at fault
    steps: int = 0
    seconds: float = 0.0           # the student's engine, measured here around the worker's call
    reference_seconds: float = 0.0


def same(a, b) -> bool:
    """Equal, floats within float32 rounding over a forward (two attention paths sum in another order: on
    SmolLM2 log-probs differ in the fifth digit); token ids, block ids and every other integer are exact."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-4,
                                                                                             abs_tol=1e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _by_step(events: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for e in events:
        steps.setdefault(int(e.get("step", 0)) if isinstance(e.get("step", 0), int) else -1, []).append(e)
    return steps


def _short(e: dict | None, other: dict | None = None) -> str:
    """An event in a line; beside another of the same type, only the fields that differ."""
    if e is None:
        return "nothing"
    same_type = other is not None and other.get("type") == e.get("type")
    fields = ", ".join(f"{k}={v!r}" for k, v in e.items() if k not in ("type", "step")
                       and not (same_type and same(other.get(k), v)))
    return f"{e.get('type')}({fields})"[:240]


def _blame(want: dict | None, got: dict | None, yours: list[str]) -> str:
    """The part whose event differs (a TokenSampled with another token: the model's attention or the sampler's
    acceptance rule, not the commit)."""
    e = want or got or {}
    kind = e.get("type", "")
    part = OWNER.get(kind, "")
    if kind == "TokenSampled" and want and got and want.get("token_id") != got.get("token_id"):
        part = "rejection-sampling" if "rejection-sampling" in yours and "paged-attention" not in yours \
            else "paged-attention"
    if kind == "StepFinished" and want and got and want.get("num_prefill_tokens") != got.get("num_prefill_tokens"):
        part = "scheduler-budget"
    if part and part not in yours:
        return f"one of your parts ({part}, whose event it is, is the reference's here)"
    return part


def compare(name: str, want: dict, got: dict, yours: list[str]) -> ScenarioResult:
    """Step by step, the reference's events against the student's; then the replay and the completions."""
    from nanoserve.trace import event_from_dict
    from nanoserve.trace_check import check_trace

    w, g = _by_step(want["events"]), _by_step(got["events"])
    for k in sorted(set(w) | set(g)):
        a, b = w.get(k, []), g.get(k, [])
        if not same(a, b):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if not same(x, y)), min(len(a), len(b)))
            x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
            return ScenarioResult(name, False, f"step {k}: your engine {_short(y, x)}, the reference {_short(x, y)}",
                                  _blame(x, y, yours), len(g))
    try:
        check_trace([event_from_dict(e) for e in got["events"]], f"{name} (your engine's events)")
    except (ValueError, KeyError, TypeError) as exc:
        return ScenarioResult(name, False, " ".join(str(exc).split())[:300], "", len(g))
    if not same(got["outputs"], want["outputs"]):
        rid = next((r for r in want["outputs"] if not same(got["outputs"].get(r), want["outputs"][r])),
                   next(iter(got["outputs"].keys() - want["outputs"].keys()), "?"))
        return ScenarioResult(name, False, f"request {rid}: your engine's completions "
                              f"{got['outputs'].get(rid)}, the reference's {want['outputs'][rid]}", "step-commit")
    return ScenarioResult(name, True, steps=int(got.get("steps", 0)))


def _plain(text) -> dict:
    """The worker's report, checked to be what `run_scenario` returns (plain data), or ValueError."""
    if not isinstance(text, str):
        raise ValueError("the worker's report is not text")
    data = json.loads(text)
    if not (isinstance(data, dict) and isinstance(data.get("events"), list) and isinstance(data.get("outputs"), dict)
            and all(isinstance(e, dict) for e in data["events"])):
        raise ValueError("the worker's report is not a scenario's events and outputs")
    return data


def _fault(exc: BaseException, parts: list[Part]) -> tuple[str, str]:
    """(where, the part whose file it is) for an exception from the student's engine. A call that reached a
    withheld body of the engine ("this check runs your code; the engine's own `Q` ...") is the fault of the
    part that should have written `Q`, wherever the call came from."""
    from nanoserve.labs import get_lab
    from nanoserve.labs.load import frames_of, where
    from nanoserve_labkit.blanks import verdict
    said = verdict(exc)
    if said:
        owner = next((p for p in parts if p.path is not None and any(f"`{q}`" in said for q in get_lab(p.lab).blanks)),
                     None)
        if owner is not None:
            return f"{said}: {owner.path.name} takes it from the engine instead of writing it", owner.lab
    for part in parts:
        if part.path is not None and any(Path(f[0]).name == part.path.name for f in frames_of(exc)):
            return where(exc, part.path), part.lab
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300], ""
