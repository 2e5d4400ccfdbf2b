"""Running a lab's checks against a student's file, each with a time limit.

The checks run in a worker process (`python -m nanoserve.labs.worker`) that
imports the student's file once and runs the checks in order, reporting
each result as one JSON line. The parent gives every check its own time
limit: a check that never returns (an endless loop in the student's free
queue, a scheduler that livelocks) is reported as timed out, the worker is
stopped, and a fresh worker goes on with the next check. A student's file
therefore cannot hang the grader, crash it, or leak state between checks
(every check builds its own engine).

`run_in_process` runs the same checks without the worker, for tests of
files known to return (a check that hangs there hangs the caller).
"""

from __future__ import annotations

import enum
import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from nanoserve.labs.lab import CheckFailed, Context, Lab
from nanoserve.labs.load import LoadError, load_student, where

STARTUP_S = 300.0   # importing torch and the student's file, before the first check starts (shared machines)


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"


@dataclass(slots=True)
class CheckResult:
    """One row of the results table."""

    check: str
    status: Status
    detail: str = ""     # what went wrong (empty when it passed)
    hint: str = ""       # what to look at (empty when it passed)

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "status": self.status.value})

    @classmethod
    def from_json(cls, line: str) -> CheckResult:
        d = json.loads(line)
        return cls(d["check"], Status(d["status"]), d["detail"], d["hint"])


def run_one(ctx: Context, index: int) -> CheckResult:
    """Run check `index`; any exception becomes a failed row naming the student's file and line."""
    check = ctx.lab.checks[index]
    try:
        check.run(ctx)
    except CheckFailed as exc:
        return CheckResult(check.name, Status.FAIL, " ".join(str(exc).split()), exc.hint or check.hint)
    except AssertionError as exc:   # check_invariants() and the pool's own checks
        return CheckResult(check.name, Status.FAIL, f"invariant broken: {invariant_text(exc)}", check.hint)
    except BaseException as exc:    # the student's code raised (or called exit)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return CheckResult(check.name, Status.FAIL, where(exc, ctx.path), check.hint)
    return CheckResult(check.name, Status.PASS)


def invariant_text(exc: AssertionError) -> str:
    """An assertion's message, or (a bare `assert`) where it stands and its source line."""
    if str(exc).strip():
        return " ".join(str(exc).split())
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an assertion failed"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}: {(f.line or 'assert').strip()}"


def load_failed(lab: Lab, message: str) -> list[CheckResult]:
    return [CheckResult(c.name, Status.FAIL, message, "fix the file so that `python FILE` runs, then check again")
            for c in lab.checks]


def run_in_process(lab: Lab, path: str | Path) -> list[CheckResult]:
    """Every check, in this process (no time limits)."""
    try:
        module = load_student(path)
    except LoadError as exc:
        return load_failed(lab, str(exc))
    ctx = Context(lab, module, str(path))
    return [run_one(ctx, i) for i in range(len(lab.checks))]


def run_checks(lab: Lab, path: str | Path, time_limit_s: float | None = None) -> list[CheckResult]:
    """Every check of `lab` on the file at `path`, in worker processes, each within its time limit
    (`time_limit_s` replaces every check's own limit, e.g. a teacher's slower machine)."""
    results: list[CheckResult] = []
    while len(results) < len(lab.checks):
        results += _worker_run(lab, Path(path), len(results), time_limit_s)
    return results


def _worker_run(lab: Lab, path: Path, start: int, override: float | None) -> list[CheckResult]:
    """Run checks from `start` in one worker until they end, the worker dies, or one overruns."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.labs.worker", lab.name, str(path), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    results: list[CheckResult] = []
    limit = STARTUP_S + lab.checks[start].time_limit_s
    try:
        while True:
            try:
                line = lines.get(timeout=limit)
            except queue.Empty:    # the running check overran its limit
                check = lab.checks[start + len(results)]
                return results + [CheckResult(check.name, Status.TIMEOUT,
                                              f"still running after {override or check.time_limit_s:g} s (stopped)",
                                              "a loop that never ends: " + check.hint)]
            if line is None:       # the worker died (the student's code killed the process?)
                if start + len(results) < len(lab.checks):
                    check = lab.checks[start + len(results)]
                    return results + [CheckResult(check.name, Status.FAIL, "the check's process died "
                                                  f"(exit code {proc.wait()})", check.hint)]
                return results
            msg = json.loads(line)
            if "load_error" in msg:
                return load_failed(lab, msg["load_error"])[start:]
            if "started" in msg:
                limit = override or lab.checks[msg["started"]].time_limit_s
            else:
                results.append(CheckResult.from_json(line))
                limit = STARTUP_S
    finally:
        proc.kill()
        proc.wait()
