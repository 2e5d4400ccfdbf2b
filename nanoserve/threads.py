"""How many CPU threads torch may use: the cores that are free right now.

torch starts one OpenMP thread per core. On an idle machine that is right;
on a busy one (a classroom laptop with a browser, two engines side by side,
a test run next door) those threads wait for each other at every barrier
while the other program holds a core, and a SmolLM2 decode step that takes
55 ms with one thread can take 1.5 s with two. So nanoserve looks before it
starts: it samples how busy each core it may run on is (a fifth of a second,
with psutil), and uses only the cores that are free, at least one.

An explicit choice always wins, first to last:

    nanoserve generate --threads 2 ...          the command line
    NANOSERVE_THREADS=2 nanoserve ...           nanoserve's variable
    OMP_NUM_THREADS=2 nanoserve ...             OpenMP's own, which torch reads too

`benchmarks/bench_threads.py` measures a step on a loaded machine with this
policy, with one thread and with torch's default.

One thread does the parallel work. OpenMP (torch's CPU threads and the C
kernels' are one runtime, libgomp) gives every thread that starts parallel
work a team of workers of its own, kept until that thread ends. Between two
parallel regions the workers spin, ready for the next one, but only while the
process holds no more OpenMP threads than it has CPUs; past that they sleep at
every barrier, and waking them is a system call. A server that loaded the
model on the main thread and stepped it on the engine thread held two teams:
on 2 cores a SmolLM2 decode step took 17 ms instead of 11, with some 380
sleeps a step (`benchmarks/bench_threads.py --teams` shows it).
`on_a_thread_that_ends` builds an engine on a thread that then ends, taking
its team with it, so the thread that steps the engine holds the only one.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

THREADS_ENV = "NANOSERVE_THREADS"
SAMPLE_S = 0.2          # how long to watch the cores
SLACK = 0.3             # a core counts as free when at most 70% of it is busy


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask; all of them where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_cores(cores: list[int], sample_s: float = SAMPLE_S) -> float:
    """How many of `cores` other programs keep busy, sampled over `sample_s` (we sleep meanwhile)."""
    try:
        import psutil
    except ImportError:                     # no psutil: the load average, a slower but fair signal
        return min(float(len(cores)), os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0
    per_cpu = psutil.cpu_percent(interval=sample_s, percpu=True)   # % busy of each CPU, the whole machine
    return sum(per_cpu[c] for c in cores if c < len(per_cpu)) / 100


def free_threads(sample_s: float = SAMPLE_S) -> int:
    """Threads worth running now: the usable cores minus the busy ones, at least 1."""
    cores = usable_cores()
    free = len(cores) - busy_cores(cores, sample_s)
    return max(1, min(len(cores), int(free + SLACK)))


def explicit_threads(requested: int | None = None) -> tuple[int, str] | None:
    """(threads, where that came from) when the user chose; ValueError for a choice that is not a count."""
    for value, source in ((requested, "--threads"), (os.environ.get(THREADS_ENV), THREADS_ENV),
                          (os.environ.get("OMP_NUM_THREADS"), "OMP_NUM_THREADS")):
        if value is None or value == "":
            continue
        try:
            count = int(value)
        except ValueError:
            raise ValueError(f"{source} must be a whole number of threads, got {value!r}") from None
        if count < 1:
            raise ValueError(f"{source} must be at least 1, got {count}")
        return count, source
    return None


def choose_threads(requested: int | None = None, sample_s: float = SAMPLE_S) -> tuple[int, str]:
    """(threads, why): the user's choice, or the cores free right now."""
    chosen = explicit_threads(requested)
    if chosen is not None:
        return chosen
    cores = len(usable_cores())
    threads = free_threads(sample_s)
    return threads, f"{threads} of {cores} cores free"


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    threads: int
    why: str            # "--threads", "NANOSERVE_THREADS", "OMP_NUM_THREADS" or "1 of 2 cores free"

    def note(self) -> str | None:
        """A line for the user when the policy left busy cores out; None when nothing needs saying."""
        if not self.why.endswith("free") or self.threads >= len(usable_cores()):
            return None
        return (f"nanoserve: using {self.threads} thread{'s' if self.threads > 1 else ''} ({self.why}; the "
                f"others are busy; --threads or {THREADS_ENV} sets it)")


def apply_thread_policy(requested: int | None = None) -> ThreadChoice:
    """Set torch's thread count by the policy above; returns the choice (its `note()` is for the user).

    Before torch is imported this sets OMP_NUM_THREADS, which torch reads at
    import (so a replay that never loads a model never imports torch); after,
    it calls `torch.set_num_threads`.
    """
    choice = ThreadChoice(*choose_threads(requested))
    if "torch" in sys.modules:
        import torch
        torch.set_num_threads(choice.threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    return choice


def on_a_thread_that_ends(fn: Callable[[], T], name: str = "nanoserve-load") -> T:
    """`fn()` run on a new thread, waited for: its result, or its exception raised here. The thread's OpenMP
    team ends with it (module docstring): build an engine this way when another thread will step it."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 -- raised again on the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)   # daemon: Ctrl-C while loading exits
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value
