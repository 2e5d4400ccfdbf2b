"""Distributed faults: bad sizes fail before any process starts; a dead worker is a clear error within
seconds and leaves no process behind; a killed driver takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.distributed import WorkerDied
from nanoserve.distributed.messages import Step
from nanoserve.errors import FieldError

ROOT = Path(__file__).resolve().parent.parent


def spawned_children() -> list[int]:
    """Pids of live processes this process started with multiprocessing's spawn (zombies excluded)."""
    me, out = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z" and b"spawn" in cmdline:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tp_engine(loaded, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.name, block_size=4, num_blocks=64, tensor_parallel_size=2, **config),
                     loaded=loaded)


@pytest.mark.parametrize("size", [0, -1, 2.0, True])
def test_a_size_below_one_is_a_field_error(size):
    with pytest.raises(FieldError) as info:
        EngineConfig(model="tiny-llama", tensor_parallel_size=size)
    assert info.value.field == "tensor_parallel_size"


@pytest.mark.parametrize("model,size", [("tiny_llama", 3), ("tiny_llama", 4), ("tiny_gpt2", 3), ("tiny_gpt2", 8)])
def test_a_size_that_does_not_divide_the_heads_fails_before_any_process_starts(request, model, size):
    loaded = request.getfixturevalue(model)
    before = spawned_children()
    with pytest.raises(FieldError, match=r"tensor_parallel_size must divide the model's \d+ attention heads") as info:
        LLMEngine(EngineConfig(model=loaded.name, tensor_parallel_size=size), loaded=loaded)
    assert info.value.field == "tensor_parallel_size"
    assert spawned_children() == before


def test_killing_a_worker_between_steps(tiny_llama):
    engine = tp_engine(tiny_llama)
    engine.add_request("r", "Hello there", SamplingParams(max_tokens=40, temperature=0))
    for _ in range(3):
        engine.step()
    (pid,) = engine.runner.group.pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=rf"tensor-parallel worker rank 1 \(pid {pid}\) was killed by SIGKILL"):
        engine.step()
    assert time.monotonic() - t0 < 15
    assert spawned_children() == []
    with pytest.raises(WorkerDied):                      # the engine stays broken, and says so at once
        engine.step()


def test_killing_a_worker_inside_a_collective(tiny_gpt2):
    """The driver is blocked in an all-reduce waiting for a stopped worker when the worker is killed."""
    engine = tp_engine(tiny_gpt2)
    engine.add_request("r", "Hello there", SamplingParams(max_tokens=40, temperature=0))
    engine.step()
    (pid,) = engine.runner.group.pids
    os.kill(pid, signal.SIGSTOP)                         # the worker hangs: the driver's next step waits on it
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerDied, match="was killed by SIGKILL"):
            engine.step()
    finally:
        killer.join()
    assert 1.0 <= time.monotonic() - t0 < 15            # it waited for the kill, then knew at once
    assert spawned_children() == []


def test_a_worker_that_raises_says_why(tiny_gpt2):
    engine = tp_engine(tiny_gpt2)
    engine.add_request("r", "Hello there", SamplingParams(max_tokens=40, temperature=0))
    engine.step()
    engine.runner.comm.broadcast_object(Step([("bogus", [(0, 1)])], []))    # a message no worker understands
    with pytest.raises(WorkerDied, match=r"rank 1 \(pid \d+\) exited with code 1: ValueError: unknown block move"):
        engine.step()
    assert spawned_children() == []


def test_a_killed_driver_leaves_no_worker(tiny_gpt2_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from nanoserve import EngineConfig, LLMEngine
        if __name__ == "__main__":
            engine = LLMEngine(EngineConfig(model={tiny_gpt2_dir!r}, num_blocks=32, tensor_parallel_size=2))
            print(engine.runner.group.pids[0], flush=True)
            time.sleep(120)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        worker = int(driver.stdout.readline())
        assert alive(worker)
        driver.kill()                                    # SIGKILL: no cleanup code runs in the driver
        driver.wait(10)
        deadline = time.monotonic() + 15
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "the worker outlived its driver"
    finally:
        driver.kill()
