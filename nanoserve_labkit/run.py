"""Running a lab's checks on a student's file: the checks and the verdict here, the student's code in a worker.

The checker (this process) holds every check and decides pass or fail. The
student's file is imported in a worker process (`sandbox.py`, `worker.py`)
that only answers requests: the engine a check builds lives here, and the
student's component in it is a handle to the object in the worker
(`remote.py`). So the checks cannot be patched from the student's file (they
are not in its process), and nothing the worker writes on the channel is a
verdict: it is at most a wrong answer to a call.

Time: each check may keep the student's code busy for its time limit
(`--time-limit` replaces every check's own), counted while this process
waits for the worker; importing the student's file gets the same limit.
A check that runs over is stopped (the worker and everything it started is
killed) and reported as a timeout, and a fresh worker goes on with the next
check. `fail_fast` stops at the first check that does not pass (the
mutation runs: one failing check kills a mutant).

`run_checks(..., loopback=True)` runs the same checks through the same
channel code with the worker's side in this process (tests of files known
to return: no process, no time limits).
"""

from __future__ import annotations

import enum
import json
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nanoserve.labs.lab import CheckFailed, Context, Lab
from nanoserve.labs.load import invariant_text, where
from nanoserve_labkit import blanks, wire
from nanoserve_labkit.confine import undumpable
from nanoserve_labkit.remote import Endpoint, Loopback, Proxy
from nanoserve_labkit.sandbox import WorkerProcess
from nanoserve_labkit.wire import ChannelBroken, Deadline

STARTUP_S = 180.0      # the worker importing the engine's modules (torch, Triton), before the student's file
OWN_TIME_S = 120.0     # what a check may spend in this process on top of its limit (building engines, the model)


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    SKIPPED = "not run"


@dataclass(slots=True)
class CheckResult:
    """One row of the results table."""

    check: str
    status: Status
    detail: str = ""     # what went wrong (empty when it passed)
    hint: str = ""       # what to look at (empty when it passed)
    function: str = ""   # the function the check judges ("" for a check of the whole component)

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "status": self.status.value})



class Session:
    """One student's file on the checker's side: the worker (started when needed), the channel, the module."""

    def __init__(self, lab: Lab, path: Path, loopback: bool = False, time_limit_s: float | None = None,
                 confine: str = "landlock", others: tuple = ()) -> None:
        """`others`: (lab, path) of more student files whose labs' bodies the worker withholds too (the
        capstone's other parts; their files are loaded by the lab's own helpers)."""
        self.lab, self.path, self.loopback, self.confine = lab, path.resolve(), loopback, confine
        self.others = tuple((other, Path(p).resolve()) for other, p in others)
        # the worker's CPU-time cap: twice every check's limit, and the imports (a last line of defence:
        # the limits above stop a check first)
        self.cpu_s = int(2 * sum(time_limit_s or c.time_limit_s for c in lab.checks) + 3 * STARTUP_S)
        self.process: WorkerProcess | None = None
        self.ep: Endpoint | None = None
        self.module: Proxy | None = None

    def start(self, limit_s: float) -> Proxy:
        """The student's module, imported in a (fresh) worker within `limit_s`. Raises LoadFailed."""
        if self.module is not None:
            return self.module
        if self.loopback:
            from nanoserve_labkit import worker
            pair = Loopback()
            worker.install(pair.worker)
            self.ep = pair.parent
        else:
            if self.confine != "none":     # our /proc/PID/{fd,environ,mem} closed to the worker (confine.py)
                undumpable()
            withhold = [blanks.spec_arg(lab) for lab in (self.lab, *(lab for lab, _ in self.others))]
            self.process = WorkerProcess([*withhold, self.lab.module, *self.lab.worker_imports],
                                         cpu_s=self.cpu_s, confine=self.confine)
            read_fd, write_fd = self.process.start()
            self.ep = Endpoint(send=lambda m: wire.send(write_fd, m),
                               recv=lambda deadline: wire.recv(read_fd, deadline), strict=True)
            try:
                ready = wire.recv(read_fd, time.monotonic() + STARTUP_S)
            except (Deadline, ChannelBroken) as exc:
                self.stop()
                raise LoadFailed(Status.FAIL, f"the lab's worker process did not start ({exc.__class__.__name__}): "
                                 "is nanoserve installed for this Python?") from None
            if "ready" not in ready:
                self.stop()
                raise LoadFailed(Status.FAIL, "the lab's worker process did not start")
        self.ep.budget_s = None if self.loopback else limit_s
        # the engine's own of what the student writes
        self.ep.withheld_types = blanks.classes(self.lab, *(lab for lab, _ in self.others))
        try:
            module = self.ep.request({"op": "load", "path": str(self.path), "blanks": list(self.lab.blanks),
                                      "also": [str(p) for _, p in self.others]})
        except Deadline:
            self.stop()
            raise LoadFailed(Status.TIMEOUT, f"importing {self.path.name} did not finish within {limit_s:g} s "
                             "(it blocks at import: input(), time.sleep, a lock, an endless loop?); stopped") from None
        except ChannelBroken:
            self.stop()
            raise LoadFailed(Status.FAIL, f"the worker process ended while importing {self.path.name}: "
                             "sys.exit or os._exit at import?") from None
        except Exception as exc:   # noqa: BLE001 -- the worker's LoadError, one line with file and line
            self.stop()
            text = str(exc) if type(exc).__name__ == "LoadError" else where(exc, self.path)
            raise LoadFailed(Status.FAIL, text) from None
        finally:
            if self.ep is not None:
                self.ep.budget_s = None
        if not (isinstance(module, Proxy) and module._rpc_kind == "module"):
            self.stop()
            raise LoadFailed(Status.FAIL, f"importing {self.path.name} answered something that is not a module: "
                             "the file wrote to the lab's channel?")
        self.module = module
        return self.module

    def helper(self, name: str, *args, **kwargs):
        """Run the lab helper `name` ("module:function") in the worker, next to the student's code."""
        return self.ep.call({"op": "helper", "f": name}, args, kwargs)

    def end_check(self) -> None:
        """Forget the check's objects on both sides (the module stays)."""
        if self.ep is None or self.module is None:
            return
        try:
            self.ep.budget_s = None if self.loopback else 30.0
            self.ep.request({"op": "reset"})
        except (ChannelBroken, Deadline, Exception):   # noqa: BLE001 -- a worker that cannot reset is replaced
            self.stop()
            return
        finally:
            if self.ep is not None:
                self.ep.budget_s = None
        keep = self.module._rpc_h
        self.ep.exports, self.ep.handles = {}, {}
        self.ep.proxies = {keep: self.module}

    def stop(self) -> None:
        """End the worker and everything it started."""
        if self.process is not None:
            self.process.stop()
        self.process, self.ep, self.module = None, None, None


class LoadFailed(Exception):
    def __init__(self, status: Status, text: str) -> None:
        super().__init__(text)
        self.status = status


_models: dict = {}     # model name -> LoadedModel: loaded once per checker process (a grade run checks many files)


def run_checks(lab: Lab, path: str | Path, time_limit_s: float | None = None, fail_fast: bool = False,
               loopback: bool = False, confine: str = "landlock") -> list[CheckResult]:
    """Every check of `lab` on the file at `path`; `time_limit_s` replaces every check's own limit;
    `confine` the best confinement of the worker to use where the kernel has it (confine.LEVELS)."""
    session = Session(lab, Path(path), loopback, time_limit_s, confine)
    results: list[CheckResult] = []
    load_failed: LoadFailed | None = None     # an import that failed or blocked fails every check the same way
    try:
        for check in lab.checks:
            if fail_fast and any(not r.passed for r in results):
                results.append(CheckResult(check.name, Status.SKIPPED, "not run (stopped at the first failure)",
                                           "", check.function))
                continue
            limit = time_limit_s or check.time_limit_s
            try:
                if load_failed is not None:
                    raise load_failed
                module = session.start(limit)
            except LoadFailed as exc:
                load_failed = exc
                hint = ("a file that does not import cannot be checked: fix it so that `python FILE` runs"
                        if exc.status is Status.FAIL else "run `python FILE`: it should return at once")
                text = blanks.verdict(str(exc))
                results.append(CheckResult(check.name, exc.status, text or str(exc), blanks.HINT if text else hint,
                                           check.function))
                continue
            ctx = Context(lab, module, str(session.path), _models, session.helper)
            results.append(_run_one(ctx, check, session, limit, loopback))
            session.end_check()
    finally:
        session.stop()
    return results


def run_in_process(lab: Lab, path: str | Path, fail_fast: bool = False) -> list[CheckResult]:
    """The checks with the worker's side in this process (tests: files known to return)."""
    return run_checks(lab, path, fail_fast=fail_fast, loopback=True)


def _run_one(ctx: Context, check, session: Session, limit: float, loopback: bool) -> CheckResult:
    """One check; whatever it raises becomes its row. Timeouts and a dead worker end the worker."""
    ep = session.ep
    ep.budget_s = None if loopback else limit
    alarm = not loopback and threading.current_thread() is threading.main_thread()
    if alarm:
        def overran(signum, frame):
            raise Deadline()
        old = signal.signal(signal.SIGALRM, overran)
        signal.setitimer(signal.ITIMER_REAL, limit + OWN_TIME_S)
    try:
        check.run(ctx)
    except Deadline:
        session.stop()
        return CheckResult(check.name, Status.TIMEOUT, f"still running after {limit:g} s (stopped)",
                           "a loop that never ends: " + check.hint, check.function)
    except ChannelBroken as exc:
        session.stop()
        return CheckResult(check.name, Status.FAIL, "the worker process ended during this check, or wrote something "
                           f"else on the lab's channel ({exc}): sys.exit, os._exit, a crash?", check.hint,
                           check.function)
    except Exception as exc:       # noqa: BLE001 -- every failure is a row
        return _failed(ctx, check, exc)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        if session.ep is not None:
            session.ep.budget_s = None
    return CheckResult(check.name, Status.PASS, function=check.function)


def _failed(ctx: Context, check, exc: BaseException) -> CheckResult:
    """The row of a check that failed with `exc`: first, whether the student's code reached for the engine's
    own (blanks.py, guard.py); else the check's words, the engine's invariant, or the student's raise (one
    line naming file and line)."""
    text = blanks.verdict(exc)
    if text is not None:
        return CheckResult(check.name, Status.FAIL, text, blanks.HINT, check.function)
    if isinstance(exc, CheckFailed):
        return CheckResult(check.name, Status.FAIL, " ".join(str(exc).split()), exc.hint or check.hint, check.function)
    if isinstance(exc, AssertionError):     # the engine's invariant checks, or the student's own assert
        return CheckResult(check.name, Status.FAIL, f"invariant broken: {invariant_text(exc)}", check.hint,
                           check.function)
    return CheckResult(check.name, Status.FAIL, where(exc, ctx.path), check.hint, check.function)
