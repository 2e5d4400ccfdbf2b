"""The thread policy (nanoserve/threads.py): explicit choices win, otherwise the cores that are free;
applied before torch is imported it travels through OMP_NUM_THREADS. And a thread that builds an engine
and ends leaves no OpenMP team behind. (What each saves is measured in benchmarks/bench_threads.py,
not asserted here.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nanoserve import threads
from nanoserve.cli import main


@pytest.fixture
def no_choice(monkeypatch):
    for var in (threads.THREADS_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)


def test_explicit_choices_win_in_order(no_choice, monkeypatch):
    monkeypatch.setattr(threads, "free_threads", lambda sample_s=0: pytest.fail("sampled despite a choice"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_threads() == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv(threads.THREADS_ENV, "2")
    assert threads.choose_threads() == (2, threads.THREADS_ENV)
    assert threads.choose_threads(5) == (5, "--threads")


@pytest.mark.parametrize("value, message", [("two", "NANOSERVE_THREADS must be a whole number"),
                                            ("0", "NANOSERVE_THREADS must be at least 1")])
def test_bad_choices_say_where_they_came_from(no_choice, monkeypatch, value, message):
    monkeypatch.setenv(threads.THREADS_ENV, value)
    with pytest.raises(ValueError, match=message):
        threads.choose_threads()


@pytest.mark.parametrize("busy, expected", [(0.0, 2), (0.2, 2), (0.8, 1), (1.0, 1), (2.0, 1)])
def test_free_cores_decide(no_choice, monkeypatch, busy, expected):
    monkeypatch.setattr(threads, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(threads, "busy_cores", lambda cores, sample_s=0: busy)
    assert threads.choose_threads() == (expected, f"{expected} of 2 cores free")
    note = threads.ThreadChoice(*threads.choose_threads()).note()
    assert (note is None) == (expected == 2)
    assert threads.ThreadChoice(1, "--threads").note() is None          # the user chose: nothing to say


def test_busy_cores_is_measured(no_choice):
    cores = threads.usable_cores()
    assert 0.0 <= threads.busy_cores(cores, sample_s=0.05) <= len(cores)
    assert 1 <= threads.free_threads(sample_s=0.05) <= len(cores)


def test_before_torch_is_imported_it_goes_through_the_environment(tmp_path):
    code = ("import os, sys\nfrom nanoserve.threads import apply_thread_policy\n"
            "n = apply_thread_policy(1).threads\nassert 'torch' not in sys.modules\nimport torch\n"
            "print(n, os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", threads.THREADS_ENV)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["1", "1", "1"], done.stderr


def test_cli_threads_flag_sets_torch(no_choice, capsys):
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--threads", "1", "--max-tokens", "2", "Hi"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _threads_alive() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts this process's threads in /proc")
def test_a_thread_that_ends_takes_its_openmp_workers_with_it():
    """The engine's loader thread leaves no OpenMP team behind (threads.py: two teams on a machine's every CPU
    make every barrier a sleep), while the same work on a thread that stays keeps its workers."""
    import threading
    import time

    if "openmp" not in torch.__config__.parallel_info().lower():
        pytest.skip("torch's CPU threads are not OpenMP here")
    threads_before = torch.get_num_threads()

    def parallel_work() -> int:
        torch.set_num_threads(2)                    # this thread's team: itself and one worker
        (torch.rand(1 << 22) * 2).sum()             # big enough for torch to split across the team
        return _threads_alive()

    try:
        before = _threads_alive()
        during = threads.on_a_thread_that_ends(parallel_work)
        assert during >= before + 2                 # the loader and its worker
        deadline = time.monotonic() + 10            # the worker is told to exit when its thread ends
        while _threads_alive() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads_alive() == before

        stay, done = threading.Event(), threading.Event()

        def work_then_wait() -> None:
            parallel_work()
            done.set()
            stay.wait(10)

        keeper = threading.Thread(target=work_then_wait)
        keeper.start()
        done.wait(10)
        assert _threads_alive() >= before + 2       # a thread that stays keeps its team
        stay.set()
        keeper.join()
    finally:
        torch.set_num_threads(threads_before)


def test_a_thread_that_ends_gives_back_the_result_or_the_error():
    assert threads.on_a_thread_that_ends(lambda: 42) == 42
    with pytest.raises(ValueError, match="no such model"):
        threads.on_a_thread_that_ends(lambda: (_ for _ in ()).throw(ValueError("no such model")))
