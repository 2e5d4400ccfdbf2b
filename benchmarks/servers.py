"""The server lifecycle the serving benchmarks share: a free loopback port, a wait for /health, a stop.

bench_serving.py, serving_overhead.py, vllm_bench_serve.py and bench_llamacpp.py each start one server at a
time (nanoserve, transformers, vLLM or llama.cpp), time a workload against it, and stop it by its own process.
"""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
