"""The lab's worker and channel: a student's file that misbehaves (does not parse, loops, allocates without end,
exits, prints megabytes, blocks at import, forks, patches the checks, writes to the channel, deletes its folder)
ends in a verdict within the time limit, one line per check, no traceback, nothing left running, and no pass
it did not earn; and the channel gives the student's code only the engine parts it was handed."""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest

from nanoserve import block_pool
from nanoserve.labs import get_lab
from nanoserve_labkit import wire
from nanoserve_labkit.remote import Loopback, Refused
from nanoserve_labkit.run import Status, run_checks
from nanoserve_labkit.wire import ChannelBroken

GOOD = inspect.getsource(block_pool)
LIMIT = 5.0


def unit_checks():
    """block-pool without its engine check: the worker matters here, not the model."""
    lab = get_lab("block-pool")
    return dataclasses.replace(lab, checks=tuple(c for c in lab.checks if c.function or c.name.startswith("sig")))


def override(body: str) -> str:
    """GOOD, with BlockPool.allocate replaced by `body` (indented as a method body)."""
    return GOOD + "\n\n_Good = BlockPool\n\n\nclass BlockPool(_Good):\n    def allocate(self, n):\n" + \
        textwrap.indent(textwrap.dedent(body), "        ") + "\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (reaped soon) counts as gone
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


FORK = """
import os, time
if os.fork() == 0:                      # a child that leaves its session and double-forks
    os.setsid()
    if os.fork() == 0:                  # (it holds a file named by the marker open in its scratch folder: that
        held = open({marker!r}, "w")    # is how the test finds it; it may start no program, see labkit/guard.py)
        while True:
            time.sleep(600)
    os._exit(0)
"""


def marked(marker: str) -> list[int]:
    """The pids of live processes that hold a file whose name is `marker` open."""
    pids = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            pid = int(fd.parent.parent.name)
            if marker in os.readlink(fd) and _alive(pid) and pid not in pids:
                pids.append(pid)
        except (OSError, ValueError):
            pass
    return pids


class Watch(threading.Thread):
    """Every pid seen running with `marker` while the watch is on."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.seen, self.on = marker, set(), True

    def run(self) -> None:
        while self.on:
            self.seen.update(marked(self.marker))
            time.sleep(0.05)

PATCH_CHECKS = """
import nanoserve.labs
for c in nanoserve.labs.get_lab("block-pool").checks:
    object.__setattr__(c, "run", lambda ctx: None)
"""

WRITE_CHANNEL = """
import json, os, struct
for fd in range(3, 40):
    for message in ({"re": 1, "ok": None}, {"check": "x", "status": "pass"}):
        data = json.dumps(message).encode()
        try:
            os.write(fd, struct.pack("!I", len(data)) + data)
        except OSError:
            pass
"""


def cases(marker):
    return {
        "syntax": ("def broken(:\n", "fail", "syntax error"),
        "loops": (override("while True:\n    pass"), "timeout", "still running after"),
        "huge": (GOOD + "\nx = bytearray(1 << 40)\n", "fail", "MemoryError"),
        "exits_at_import": ("import sys\nsys.exit(3)\n", "fail", "SystemExit"),
        "exits_in_a_call": (override("raise SystemExit(0)"), "fail", "SystemExit"),
        "os_exit": (override("import os\nos._exit(0)"), "fail", "worker process ended"),
        "input": (GOOD + "\ninput()\n", "fail", "EOFError"),
        "blocks_at_import": (GOOD + "\nimport time\ntime.sleep(600)\n", "timeout", "did not finish within"),
        "prints_megabytes": (GOOD + "\nfor _ in range(4000):\n    print('x' * 500)\n", "pass", ""),
        "forks": (GOOD + FORK.format(marker=marker), "pass", ""),
        "patches_checks": (override("return []") + PATCH_CHECKS, "fail", "allocate"),
        "writes_to_channel": (override("return []") + WRITE_CHANNEL, "fail", ""),
        "deletes_its_folder": (GOOD + "\nimport os\nfor f in os.listdir('.'):\n    os.remove(f)\n", "pass", ""),
    }


def test_misbehaving_files_end_in_a_verdict(tmp_path, monkeypatch):
    lab = unit_checks()
    folder = tmp_path / "submissions"
    folder.mkdir()
    (folder / "keep.txt").write_text("the teacher's file")
    monkeypatch.chdir(folder)
    marker = f"nanoserve-test-{os.getpid()}-{time.monotonic_ns()}"
    watch = Watch(marker)
    watch.start()
    for name, (text, want, phrase) in cases(marker).items():
        path = folder / f"{name}.py"
        path.write_text(text)
        t0 = time.monotonic()
        # (patching the checks imports the labs, and with them torch: give that import time)
        rows = run_checks(lab, path, time_limit_s=60 if name == "patches_checks" else LIMIT)
        seconds = time.monotonic() - t0
        assert len(rows) == len(lab.checks)
        for r in rows:
            assert "\n" not in r.detail and "Traceback" not in r.detail, (name, r.detail)
        statuses = {r.status.value for r in rows}
        if want == "pass":
            assert statuses == {"pass"}, (name, [(r.check, r.detail) for r in rows if not r.passed])
        else:
            allocate = next(r for r in rows if r.function == "BlockPool.allocate")
            assert allocate.status.value == want, (name, allocate.detail)
            assert phrase in allocate.detail, (name, allocate.detail)
        if name == "blocks_at_import":      # one import, one limit: not one per check
            assert seconds < 3 * LIMIT + 60, seconds
    assert (folder / "keep.txt").read_text() == "the teacher's file"   # it ran in a scratch folder
    watch.on = False
    watch.join()
    assert watch.seen, "the forking file's grandchild never ran"
    assert all(_gone(pid) for pid in watch.seen), "a process the student's file started outlived the check"


@pytest.mark.parametrize("command", ["check", "grade"])
def test_nothing_outlives_a_killed_checker(command, tmp_path):
    """`kill -9` of `nanoserve lab check` (or `lab grade`, whose checker of the file is a process of its own)
    itself: the guardian still kills the worker and what it started."""
    marker = f"nanoserve-test-{os.getpid()}-{time.monotonic_ns()}"
    path = tmp_path / "stuck.py"
    path.write_text(override("while True:\n    pass") + FORK.format(marker=marker))
    target = str(path) if command == "check" else str(tmp_path)
    checker = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "lab", command, "block-pool", target],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not marked(marker):
        assert time.monotonic() < deadline and checker.poll() is None, "the student's file never ran"
        time.sleep(0.1)
    (pid,) = marked(marker)
    time.sleep(1.0)                     # the check is now spinning in allocate
    checker.send_signal(signal.SIGKILL)
    checker.wait()
    assert _gone(pid), f"the grandchild outlived a killed `lab {command}`"


# -- the channel ---------------------------------------------------------------------------------


PROBE = """
def probe(thing):
    found = []
    for name in ("_secret", "module", "function", "data"):
        try:
            value = getattr(thing, name)
            found.append((name, "got " + value.__class__.__name__))
        except AttributeError as exc:
            found.append((name, type(exc).__name__ + ": " + str(exc)))
    try:
        thing.data = [1]
        found.append(("set data", "set"))
    except AttributeError as exc:
        found.append(("set data", str(exc)))
    return found
"""


def test_the_worker_gets_only_what_it_was_handed(tmp_path):
    from nanoserve_labkit import worker
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    pair = Loopback()
    worker.install(pair.worker)
    module = pair.parent.request({"op": "load", "path": str(path)})
    thing = types.SimpleNamespace(_secret=1, module=os, function=lambda: None, data=[1, 2])
    found = dict(module.probe(thing))
    assert found["data"] == "got list"                        # a plain container: shared, as a component needs
    for name in ("_secret", "module", "function"):            # a private name, a module, a function: refused
        assert found[name].startswith("Refused") and "does not give your code" in found[name], found   # (an
        # AttributeError: `except AttributeError` in the student's code catches it)
    assert "may not set" in found["set data"]                 # not an engine object: no attribute changes
    with pytest.raises(Refused):
        pair.parent.encode(os, guard=True)


def test_the_channel_reads_frames_never_pickles(tmp_path):
    read_fd, write_fd = os.pipe()
    try:
        for garbage in (b"\x00\x00\x00\x05hello", b"\x00\x00\x00\x02[]", b"\xff\xff\xff\xff"):
            os.write(write_fd, garbage)
            with pytest.raises(ChannelBroken):
                wire.recv(read_fd, time.monotonic() + 5)
        with pytest.raises(wire.Deadline):
            wire.recv(read_fd, time.monotonic() + 0.1)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    pair = Loopback()
    with pytest.raises(ChannelBroken):                        # a handle the parent never handed over
        pair.parent.decode({"T": "home", "h": 12345})
    with pytest.raises(ChannelBroken):                        # a tag that is not the protocol's
        pair.parent.decode({"T": "pickle", "v": "gASVAAAA"})
    assert Status.SKIPPED.value == "not run"
