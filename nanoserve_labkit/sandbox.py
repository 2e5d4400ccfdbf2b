"""Where a student's code runs: a worker process in its own session and scratch folder, and a guardian.

    checker ──channel (2 pipes)──────────────▶ worker (the student's code, resource limits)
       └──lifeline (1 pipe)──▶ guardian ──starts──┘   (session leader, subreaper)

`WorkerProcess.start()` starts the guardian (`python -m nanoserve_labkit.sandbox`)
in a new session with the scratch folder as its working directory; the
guardian marks itself a child subreaper (Linux) and starts the worker
(`worker.py`). Then it waits on the lifeline. When the lifeline closes,
because the checker is done with this worker, or because the checker ended
in any way at all (an exception, Ctrl-C, `kill -9`: the kernel closes the pipe),
the guardian kills every process below it: the worker, and whatever the
student's code started. Processes that lose their parent are handed to the
subreaper, not to init, so a child that double-forks or calls setsid() is
still found and killed. The scratch folder is removed afterwards.

Both run isolated (`python -I -B`: no PYTHONPATH, no user site, no bytecode
written), with nanoserve's own folder named on the command line
(`isolated()`), so an addition to the user's import path is never imported
here. The worker is confined by the kernel where it can be (`confine.py`:
Landlock, else a PID namespace): it writes only in its scratch folder and
cannot signal or read the checker. What stays possible (it reads the user's
files, talks to the network) is said on the teacher's page; for grading
strangers' files, use a container or a throwaway account.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanoserve_labkit import confine

PR_SET_CHILD_SUBREAPER = 36

# `python -I -c BOOT ROOTS MODULE ARGS...`: MODULE run as __main__ with ROOTS (nanoserve's folders) first on the path
BOOT = ("import os, runpy, sys\n"
        "roots = sys.argv.pop(1).split(os.pathsep); name = sys.argv.pop(1)\n"
        "sys.path[:0] = [r for r in roots if r not in sys.path]\n"
        "runpy.run_module(name, run_name='__main__', alter_sys=True)\n")


def package_roots() -> str:
    """The folders this process imported nanoserve and nanoserve_labkit from (os.pathsep between)."""
    import nanoserve
    import nanoserve_labkit
    roots = [str(Path(m.__file__).resolve().parent.parent) for m in (nanoserve_labkit, nanoserve)]
    return os.pathsep.join(dict.fromkeys(roots))


def isolated(module: str, *args: str, roots: str | None = None) -> list[str]:
    """The command line that runs `python -m module args` isolated, importing nanoserve from `roots`."""
    return [sys.executable, "-I", "-B", "-c", BOOT, roots or package_roots(), module, *args]


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (/proc/PID/task/*/children, or every /proc/*/stat where that file is missing)."""
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    kids = []
    for task in tasks:
        try:
            kids += [int(x) for x in task.read_text().split()]
        except OSError:
            pass
    if tasks:
        return kids
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _kill_descendants() -> None:
    """SIGKILL every process below this one, again and again as orphans are handed to us, until none is left."""
    me = os.getpid()
    for _ in range(1000):
        kids = _children(me)
        if not kids:
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            if not _children(me):
                return
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:      # reap what died; its orphans come to us next round
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.005)
            except ChildProcessError:
                break


def guardian(argv: list[str]) -> int:
    """`python -m nanoserve_labkit.sandbox LEVEL ROOTS READ_FD WRITE_FD CPU_S MODULE...`: start the worker
    (confined as `LEVEL` allows, see confine.py), watch the lifeline."""
    level, roots, argv = argv[0], argv[1], argv[2:]
    if level in ("landlock", "namespace"):
        confine.own_namespace()          # where allowed: the worker (our next child) is PID 1 of its own namespace
    scratch = os.getcwd()

    def restrict() -> None:              # in the worker's process, before it runs anything
        if level == "landlock":
            confine.landlock(scratch)

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # only the lifeline ends us
    signal.signal(signal.SIGTERM, lambda *_: None)
    fds = (int(argv[0]), int(argv[1]))
    worker = subprocess.Popen(isolated("nanoserve_labkit.worker", *argv, roots=roots), pass_fds=fds,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=restrict)
    for fd in fds:
        os.close(fd)
    try:
        orphans_killed = False
        while True:
            ready = select.select([0], [], [], 0.2)[0]
            if ready and not os.read(0, 64):       # EOF: the checker is done (or gone)
                break
            if worker.poll() is not None and not orphans_killed:
                # The worker is gone (os._exit, a crash): what it started is an orphan holding the channel
                # open, which would keep the checker waiting for an answer until its time limit.
                _kill_descendants()
                orphans_killed = True
    finally:
        if Path("/proc/self").exists():
            _kill_descendants()
        else:                                       # no /proc (not Linux): the whole session, ourselves too
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return 0


class WorkerProcess:
    """One worker for one student's file, from `start()` to `stop()` (which leaves nothing running)."""

    def __init__(self, modules: list[str], cpu_s: int = 3600, confine: str = "landlock") -> None:
        self.modules, self.cpu_s, self.confine = modules, cpu_s, confine
        self.guardian: subprocess.Popen | None = None
        self.scratch: str | None = None
        self.read_fd = self.write_fd = self._lifeline = -1

    def start(self) -> tuple[int, int]:
        """Start the guardian and the worker; returns (read fd, write fd) of the channel's parent end."""
        self.scratch = tempfile.mkdtemp(prefix="nanoserve-lab-")
        to_worker_r, to_worker_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        life_r, life_w = os.pipe()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.scratch, "TMPDIR": self.scratch,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TRITON_INTERPRET": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        try:
            roots = package_roots()
            self.guardian = subprocess.Popen(
                isolated("nanoserve_labkit.sandbox", self.confine, roots, str(to_worker_r), str(to_parent_w),
                         str(self.cpu_s), *self.modules, roots=roots),
                stdin=life_r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(to_worker_r, to_parent_w),
                cwd=self.scratch, env=env, start_new_session=True)
        finally:
            for fd in (to_worker_r, to_parent_w, life_r):
                os.close(fd)
        self.read_fd, self.write_fd, self._lifeline = to_parent_r, to_worker_w, life_w
        return self.read_fd, self.write_fd

    def stop(self) -> None:
        """Close the lifeline (the guardian kills everything below it), wait for it, remove the scratch folder."""
        for fd in (self._lifeline, self.read_fd, self.write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lifeline = self.read_fd = self.write_fd = -1
        if self.guardian is not None:
            try:
                self.guardian.wait(timeout=20)
            except subprocess.TimeoutExpired:       # it should never hang; if it does, its whole session goes
                try:
                    os.killpg(self.guardian.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.guardian.wait()
            self.guardian = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


if __name__ == "__main__":
    sys.exit(guardian(sys.argv[1:]))
