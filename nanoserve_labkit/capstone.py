"""`nanoserve lab capstone DIR`: every part the student wrote, at once, is the engine; judged against the reference.

Where things run. The student's whole engine (their parts plugged into one
`Components`, `nanoserve/labs/capstone.py`) runs in the lab's worker process,
the same sandboxed worker `lab check` uses, one call per scenario: it returns
the scenario's events and completions as plain JSON text. Nothing else comes
back, so nothing the student's code does can reach the judge's objects. The
verdict is decided here, in the checker, from what the worker reported:

* the reference engine (the engine's own parts) runs the same scenario here;
  the two event streams must be equal step by step (a first difference is
  reported as "step k: your engine X, the reference Y", with the part whose
  event it is);
* the reported events must replay through the trace checker (`trace_check`:
  the engine's state machine, every block and ref count, every queue move);
  a report that does not decode or does not replay fails;
* the completions must equal the reference's.

A report can be forged only by producing the reference's exact events, i.e.
by running the engine's own code, which the worker withholds during grading.
Throughput is the reference's time over the student's for the same
scenarios, measured here around the worker's call: a report, never a condition.

Why not the checks' way (the engine here, each part a handle in the worker)?
With every part proxied each step makes hundreds of calls over the channel
(measured: benchmarks/capstone_rpc.py), which puts a real model's run far past
the time a capstone may take; one call per scenario costs nothing per step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.labs.capstone import LEFT_OUT, PARTS, SCENARIOS, Part, find_parts, reference_components, run_scenario

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


@dataclass(slots=True)
class Report:
    folder: str
    parts: list[Part]
    scenarios: list[ScenarioResult] = field(default_factory=list)

    @property
    def yours(self) -> list[str]:
        return [p.lab for p in self.parts if p.path is not None]

    @property
    def matches(self) -> bool:
        return bool(self.scenarios) and all(s.passed for s in self.scenarios)

    @property
    def passed(self) -> bool:
        """Every part the student's, and every scenario the reference's, step for step."""
        return self.matches and len(self.yours) == len(PARTS)

    @property
    def throughput_ratio(self) -> float | None:
        ran = [s for s in self.scenarios if s.passed and s.seconds > 0]
        if not ran:
            return None
        return sum(s.reference_seconds for s in ran) / sum(s.seconds for s in ran)

    def part_status(self, lab: str) -> tuple[str, str]:
        """(whose, result) for one part's row."""
        mine = lab in self.yours
        blamed = [s.name for s in self.scenarios if not s.passed and s.part == lab]
        if not mine:
            return "reference (not written yet)", "not yours: never a pass"
        if blamed:
            return "yours", "most likely at fault in " + ", ".join(blamed)
        return "yours", "pass" if self.matches else "no difference traced to it"

    def verdict(self) -> str:
        n, total = len(self.yours), len(PARTS)
        failed = [s for s in self.scenarios if not s.passed]
        if failed:
            s = failed[0]
            return f"capstone not passed: {s.name}: {s.detail}" + (f" (most likely: {s.part})" if s.part else "")
        if n < total:
            return (f"partial capstone: {n} of {total} parts are yours and every scenario matches the reference "
                    "(not a pass until every part is yours)")
        ratio = self.throughput_ratio
        speed = f"; throughput {ratio:.2f}x the reference's" if ratio else ""
        return f"capstone passed: every part yours, every scenario the reference's step for step{speed}"

    def to_json(self) -> dict:
        return {"folder": self.folder, "passed": self.passed, "verdict": self.verdict(),
                "parts": {p.lab: {"file": str(p.path) if p.path else None, "status": self.part_status(p.lab)[1]}
                          for p in self.parts},
                "scenarios": [{"name": s.name, "passed": s.passed, "detail": s.detail, "part": s.part,
                               "steps": s.steps} for s in self.scenarios],
                "throughput_ratio": self.throughput_ratio}


def same(a, b) -> bool:
    """Equal, floats within float32 rounding (two attention paths may round the last bit differently; token
    ids, block ids and every other integer must be exact)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-5,
                                                                                             abs_tol=1e-6)
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
    """(where, the part whose file it is) for an exception from the student's engine."""
    from nanoserve.labs.load import frames_of, where
    for part in parts:
        if part.path is not None and any(Path(f[0]).name == part.path.name for f in frames_of(exc)):
            return where(exc, part.path), part.lab
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300], ""


def judge(folder: str | Path, model: str = "tiny-llama", scenarios: tuple[str, ...] = SCENARIOS,
          loopback: bool = False, time_limit_s: float = 600.0, progress=None) -> Report:
    """Run every scenario with the student's engine (in the worker) and the reference (here); the report."""
    from nanoserve.labs import get_lab
    from nanoserve.models.loader import load_model
    from nanoserve_labkit.run import LoadFailed, Session
    from nanoserve_labkit.wire import ChannelBroken, Deadline

    parts = find_parts(folder)
    report = Report(str(folder), parts)
    yours = report.yours
    loaded = load_model(model)
    reference = reference_components(yours)
    session = None
    if yours:
        first = next(p for p in parts if p.path is not None)
        session = Session(get_lab(first.lab), first.path, loopback, time_limit_s)
    try:
        for name in scenarios:
            t0 = time.perf_counter()
            want = run_scenario(name, reference, model, loaded)
            ref_s = time.perf_counter() - t0
            if session is None:               # nothing written yet: the reference against itself
                got, seconds = want, ref_s
            else:
                try:
                    session.start(time_limit_s)
                    session.ep.budget_s = None if loopback else time_limit_s
                    t0 = time.perf_counter()
                    got = _plain(session.helper("nanoserve.labs.capstone:record_json_one", str(Path(folder).resolve()),
                                                name, model))
                    seconds = time.perf_counter() - t0
                except LoadFailed as exc:
                    report.scenarios.append(ScenarioResult(name, False, str(exc), first.lab))
                    continue
                except Deadline:
                    session.stop()
                    report.scenarios.append(ScenarioResult(name, False, f"still running after {time_limit_s:g} s "
                                                           "(stopped): a step that never ends, or a livelock"))
                    continue
                except ChannelBroken as exc:
                    session.stop()
                    report.scenarios.append(ScenarioResult(name, False, f"the worker process ended ({exc})"))
                    continue
                except ValueError as exc:
                    report.scenarios.append(ScenarioResult(name, False, f"your engine's report: {exc}"))
                    continue
                except Exception as exc:   # noqa: BLE001 -- the student's engine raised: name file, line and part
                    text, part = _fault(exc, parts)
                    report.scenarios.append(ScenarioResult(name, False, text, part))
                    continue
                finally:
                    if session.ep is not None:
                        session.ep.budget_s = None
            result = compare(name, want, got, yours)
            result.seconds, result.reference_seconds = seconds, ref_s
            report.scenarios.append(result)
            if progress is not None:
                progress(name, result)
    finally:
        if session is not None:
            session.stop()
    return report


def table(report: Report):
    """The report as rich tables: one row per part, one per scenario."""
    from rich.table import Table

    parts = Table(title=f"capstone: {report.folder}", show_lines=False)
    for col in ("part", "file", "whose", "result"):
        parts.add_column(col, overflow="fold")
    for p in report.parts:
        whose, result = report.part_status(p.lab)
        parts.add_row(p.lab, p.path.name if p.path else "-", whose, result)
    for lab, why in LEFT_OUT.items():
        parts.add_row(lab, "-", "not in the engine", why)
    runs = Table(title="scenarios (both engines, step by step)")
    for col in ("scenario", "steps", "result"):
        runs.add_column(col, overflow="fold")
    for s in report.scenarios:
        runs.add_row(s.name, str(s.steps), "same events, same outputs" if s.passed else
                     f"{s.detail}" + (f"\nmost likely: {s.part}" if s.part else ""))
    return parts, runs
