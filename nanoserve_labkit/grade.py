"""`lab grade`: each submission checked by its own checker process, in its own copy, so no file reaches another's.

    lab grade ──▶ checker (python -I, one per file, own folder) ──▶ guardian ──▶ worker (the student's code)

Before anything runs, every submission is read into memory: the grade is of
what was handed in, whatever a file's code later does to a classmate's file.
Each file is then written alone into a fresh folder and checked there by a
fresh checker process (`python -I -B`, nanoserve imported from this process's
own folder, `sandbox.isolated`), which prints one JSON row per check
(`python -m nanoserve_labkit.grade LAB FILE LIMIT CONFINE`; its stdin is its
lifeline: when `lab grade` ends, however, it ends too). So a file that
breaks its checker breaks only its own grade:

* a checker that is killed (SIGKILL, SIGTERM, ...) or stopped (SIGSTOP), or
  that runs past the file's whole time, is ended, and the file's verdict is
  "stopped its checker (...)": every check of that file fails, and the next
  file is graded;
* a checker whose output is not the lab's rows, one per check in order,
  gives the verdict "its checker's output was not the lab's rows";
* the import path's folders are watched around each file
  (`integrity.ImportPathWatch`): anything that appeared is removed, and the
  file's verdict names it (its checks fail: its checker may have imported it).

Otherwise the verdict is "checked". Grading a file costs a fresh process
(torch and the model are loaded once per file, not once per run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nanoserve_labkit.confine import landlock_abi
from nanoserve_labkit.integrity import ImportPathWatch
from nanoserve_labkit.run import OWN_TIME_S, STARTUP_S, CheckResult, Status
from nanoserve_labkit.sandbox import isolated, package_roots

CHECKED = "checked"
STOPPED = "stopped its checker"


@dataclass(slots=True)
class Graded:
    """One submission's rows, and how its checking ended (`CHECKED`, or what happened instead)."""

    results: list[CheckResult]
    verdict: str = CHECKED


def read_submissions(folder: Path) -> dict[str, bytes]:
    """Every .py file under `folder` (relative path -> bytes), read before any of them runs."""
    files = sorted(p for p in folder.rglob("*.py") if p.is_file())
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def child_import_path(roots: str) -> list[str]:
    """The folders an isolated checker imports from: what `python -I` puts on sys.path, and nanoserve's roots."""
    text = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
                          capture_output=True, text=True, timeout=60).stdout
    paths = [*json.loads(text or "[]"), *roots.split(os.pathsep)]
    return [p for p in dict.fromkeys(os.path.abspath(p) for p in paths if p) if os.path.isdir(p)]


def _failed(lab, text: str) -> list[CheckResult]:
    return [CheckResult(c.name, Status.FAIL, text, "", c.function) for c in lab.checks]


def _whole_limit(lab, time_limit_s: float | None) -> float:
    return STARTUP_S + sum((time_limit_s or c.time_limit_s) + OWN_TIME_S for c in lab.checks)


def _rows(lab, lines: list[str]) -> list[CheckResult] | None:
    """The checker's rows, or None when its output is not exactly one row per check of `lab`, in order."""
    rows = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
            rows.append(CheckResult(str(r["check"]), Status(r["status"]), str(r.get("detail", "")),
                                    str(r.get("hint", "")), str(r.get("function", ""))))
        except (ValueError, KeyError, TypeError):
            return None
    if [r.check for r in rows] != [c.name for c in lab.checks]:
        return None
    return rows


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def check_apart(lab, name: str, data: bytes, time_limit_s: float | None = None, confine: str = "landlock",
                roots: str | None = None) -> Graded:
    """Check one submission (`name`: its path under the folder, `data`: its text) in a fresh folder by a fresh
    checker process; whatever that process does, the answer is a verdict for this file."""
    roots = roots or package_roots()
    folder = tempfile.mkdtemp(prefix="nanoserve-grade-")
    try:
        copy = Path(folder, name)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(data)
        limit = "" if time_limit_s is None else repr(float(time_limit_s))
        checker = subprocess.Popen(isolated("nanoserve_labkit.grade", lab.name, str(copy), limit, confine,
                                            roots=roots),
                                   cwd=folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env={**os.environ, "TRITON_INTERPRET": "1"})
        out: list[bytes] = []
        err: list[bytes] = []
        readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
                   for s, b in ((checker.stdout, out), (checker.stderr, err))]
        for r in readers:
            r.start()
        try:
            verdict = _wait(checker, time.monotonic() + _whole_limit(lab, time_limit_s))
        finally:
            checker.stdin.close()        # its lifeline (if we are gone, it goes too: see main)
        for r in readers:
            r.join(timeout=30)
        if verdict is not None:
            return Graded(_failed(lab, f"{name}: {verdict}"), verdict)
        rows = _rows(lab, b"".join(out).decode(errors="replace").splitlines())
        if rows is None:
            last = (b"".join(err).decode(errors="replace").strip().splitlines() or [""])[-1][:200]
            verdict = "its checker's output was not the lab's rows" + (f" ({last})" if last else "")
            return Graded(_failed(lab, f"{name}: {verdict}"), verdict)
        return Graded(rows)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(checker: subprocess.Popen, deadline: float) -> str | None:
    """Wait for the checker; None when it exited by itself, else the verdict (and it is ended)."""
    while True:
        pid, status = os.waitpid(checker.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            if os.WIFSTOPPED(status):
                verdict = f"{STOPPED} ({_signal_name(os.WSTOPSIG(status))})"
                break
            checker.returncode = os.waitstatus_to_exitcode(status)
            if os.WIFSIGNALED(status):
                return f"{STOPPED} (killed by {_signal_name(os.WTERMSIG(status))})"
            return None
        if time.monotonic() > deadline:
            verdict = f"{STOPPED} (still running after the file's whole time, ended)"
            break
        time.sleep(0.05)
    checker.kill()
    os.waitpid(checker.pid, 0)
    checker.returncode = -signal.SIGKILL
    return verdict


def grade(lab, submissions: dict[str, bytes], time_limit_s: float | None = None, confine: str = "landlock",
          watch_dirs: list[str] | None = None, progress=lambda items: items) -> dict[str, Graded]:
    """Every submission, each apart (`check_apart`), the import path (or `watch_dirs`) watched around each."""
    roots = package_roots()
    if watch_dirs is None:      # (where Landlock confines the worker's writes, nothing of its can appear there)
        watch_dirs = [] if confine == "landlock" and landlock_abi() >= 1 else child_import_path(roots)
    graded = {}
    for name in progress(list(submissions)):
        watch = ImportPathWatch(watch_dirs)
        result = check_apart(lab, name, submissions[name], time_limit_s, confine, roots)
        added = watch.remove_added()
        if added:
            verdict = f"wrote into the import path: {', '.join(added)} (removed)"
            result = Graded(_failed(lab, f"{name}: {verdict}"), verdict)
        graded[name] = result
    return graded


def main(argv: list[str]) -> int:
    """The checker's side: `LAB FILE LIMIT CONFINE` -> one JSON row per check on stdout."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from nanoserve.labs import get_lab
    from nanoserve_labkit.run import run_checks

    lab_name, path, limit, confine = argv

    def lifeline() -> None:       # stdin closes when `lab grade` is done with us, or is gone (even kill -9)
        while os.read(0, 4096):   # (the raw fd: a daemon thread blocked in sys.stdin aborts the exit)
            pass
        os._exit(3)               # (our guardian's lifeline closes with us: the worker goes too)
    threading.Thread(target=lifeline, daemon=True).start()
    for row in run_checks(get_lab(lab_name), path, float(limit) if limit else None, confine=confine):
        print(row.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
