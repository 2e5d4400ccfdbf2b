"""Tensor parallelism listens on loopback only, and a size that cannot split the model is one line.

During a `--tp 2` run, every listening socket of the driver and of its worker (the rendezvous
store, each rank's gloo device) is bound to 127.0.0.1: nothing on them is authenticated and rank
to rank objects are pickles. torch's TCPStore, left to itself, listened on `[::]` (every
interface, IPv4 too) for the whole run; the driver now binds the store's socket itself.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import psutil
import pytest

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.distributed.group import loopback_store
from nanoserve.errors import FieldError


def listening(process: psutil.Process) -> list[tuple[str, int]]:
    """The (address, port) pairs `process` listens on (TCP)."""
    return [(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_a_tp_2_run_listens_on_loopback_only(tiny_llama):
    driver = psutil.Process()
    before = set(listening(driver))
    engine = LLMEngine(EngineConfig(model=tiny_llama.name, block_size=4, num_blocks=64, tensor_parallel_size=2),
                       loaded=tiny_llama)
    try:
        engine.add_request("r", "Hello there", SamplingParams(max_tokens=6, temperature=0))
        seen = {}
        while engine.has_unfinished_requests():
            engine.step()                             # between steps: the group is up, the store too
            workers = [psutil.Process(pid) for pid in engine.runner.group.pids]
            for p in [driver, *workers]:
                seen.setdefault(p.pid, set()).update(listening(p))
    finally:
        engine.shutdown()
    seen[driver.pid] -= before                        # (whatever the test process listened on already)
    assert all(seen.values()) and len(seen) == 2, seen  # the driver (store + gloo) and rank 1 (gloo) listen
    addresses = {ip for ip, _ in set().union(*seen.values())}
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses


def test_the_store_binds_loopback():
    store, port = loopback_store(1)
    store.set("k", "v")
    mine = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert mine and all(a.ip == "127.0.0.1" for a in mine), mine
    del store


def test_a_tp_larger_than_the_heads_is_a_field_error(tiny_llama):
    with pytest.raises(FieldError, match="must divide the model's 4 attention heads") as info:
        LLMEngine(EngineConfig(model=tiny_llama.name, tensor_parallel_size=100_000), loaded=tiny_llama)
    assert info.value.field == "tensor_parallel_size"
    run = subprocess.run([sys.executable, "-m", "nanoserve.cli", "generate", "--tp", "100000", "hi"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--tensor-parallel-size must divide" in run.stderr
