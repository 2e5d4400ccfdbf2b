"""Keep-alive latency with and without TCP_NODELAY on the server's connections.

    OMP_NUM_THREADS=1 python benchmarks/archive/bench_keepalive.py --requests 40

Two servers in this process, on loopback, the same engine settings (tiny-llama): one listens
on a socket made as `nanoserve serve` makes it (`listener.listen`: IPPROTO_TCP, so asyncio
sets TCP_NODELAY on every connection), the other on a socket from `socket.create_server`
(protocol 0: Nagle stays on, as before the fix). One client sends `--requests` non-streamed
2-token completions over one keep-alive connection to each, alternating, and the first
streamed chunk of as many streams; the script prints the medians and their ratio. With Nagle
on, a response written in two pieces waits for the client's delayed ACK (~40 ms on Linux).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from unittest import mock

import httpx

os.environ.setdefault("OMP_NUM_THREADS", "1")


def cpu() -> str:
    path = Path("/proc/cpuinfo")
    lines = path.read_text().splitlines() if path.exists() else []
    name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())
    flags = next((x.split(":", 1)[1].split() for x in lines if x.startswith("flags")), [])
    vector = [f for f in flags if f.startswith(("avx", "sse4", "fma", "amx"))]
    return f"{name}, {os.cpu_count()} CPUs, vector flags: {' '.join(vector) or '?'}"


def old_listen(host: str, port: int) -> socket.socket:
    """How the servers bound their socket before: protocol 0 (no TCP_NODELAY from asyncio)."""
    return socket.create_server((host, port))


def measure(url: str, model: str, n: int) -> tuple[float, float]:
    """(median ms of a whole 2-token completion, median ms to a stream's first chunk), one keep-alive client."""
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    whole, first = [], []
    with httpx.Client(timeout=60) as client:
        client.post(f"{url}/v1/completions", json=body)          # the connection is open from here on
        for _ in range(n):
            t0 = time.perf_counter()
            assert client.post(f"{url}/v1/completions", json=body).status_code == 200
            whole.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                lines = resp.iter_lines()
                next(lines)
                first.append((time.perf_counter() - t0) * 1000)
                for _ in lines:
                    pass
    return statistics.median(whole), statistics.median(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()

    from nanoserve import EngineConfig, LLMEngine
    from nanoserve.serve import background
    from nanoserve.serve.app import build_app

    print(f"machine: {cpu()}")
    config = dict(model="tiny-llama", block_size=4, num_blocks=128, max_num_batched_tokens=64)
    results = {}
    for name in ("TCP_NODELAY (listener.listen)", "Nagle on (socket.create_server)"):
        patch = mock.patch.object(background, "listen", old_listen) if "Nagle" in name else contextlib.nullcontext()
        with patch, background.BackgroundServer(build_app(LLMEngine(EngineConfig(**config)))) as server:
            results[name] = measure(server.url, "tiny-llama", args.requests)
    print(f"{args.requests} requests each, one keep-alive connection, medians (noisy on a shared machine):")
    for name, (whole, first) in results.items():
        print(f"  {name:<34} whole 2-token completion {whole:6.1f} ms   first stream chunk {first:6.1f} ms")
    (w_on, f_on), (w_off, f_off) = results.values()
    print(f"  Nagle on / TCP_NODELAY: {w_off / w_on:.1f}x (whole), {f_off / f_on:.1f}x (first chunk)")


if __name__ == "__main__":
    main()
