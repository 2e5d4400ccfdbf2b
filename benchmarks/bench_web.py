"""How many browser tabs `nanoserve web` holds, in each mode: memory, CPU and start time per tab.

    python benchmarks/bench_web.py                                  # every mode, the default tab counts
    python benchmarks/bench_web.py --modes replay,attach --tabs 1,8,16
    python benchmarks/bench_web.py --modes live --tabs 1,2,4

textual-serve runs one app process per tab. For each mode and each tab count
N, this starts `nanoserve web` (and, for attach, a `nanoserve serve` with a
client keeping its engine busy), opens N tabs at once as a class does (a
websocket each, as the browser's page opens it: the drawing itself happens
in the students' browsers, not on this machine), and measures:

    ready     seconds from opening to the first screen with the engine's step on it (median, slowest)
    USS       memory of the tabs' processes that is theirs alone (psutil's unique set size), per tab
    RSS       the same with the shared libraries counted in every process, per tab
    idle      CPU cores the tabs' processes (and the web server) use while nobody presses a key
    active    the same while every tab steps twice a second (replay, live, compare: the space key;
              attach: the server steps, the tabs only draw what it did; --shared: one tab steps, the
              teacher's, and every tab watches)

and the tab counts a 2-core, 8 GB laptop holds by each limit: memory (half of
8 GB for the tabs) and CPU (two cores while every tab is active).

The machine this runs on is shared (several agents on 2 cores): start times
and CPU figures are noisy; memory is not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import psutil
from servers import free_port

ROOT = Path(__file__).resolve().parents[1]
LAPTOP_TAB_MEMORY = 4e9          # half of an 8 GB laptop for the tabs
LAPTOP_CORES = 2
READY = {"replay": rb"step 0/", "compare": rb"step 0(?!\d)", "live": rb"step 0(?!\d)", "attach": rb"step \d+"}


def machine() -> str:
    """The CPU model and its vector flags (the numbers depend on them)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vector = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return f"cpu: {model}, {os.cpu_count()} CPUs, vector flags: {' '.join(vector) or 'none listed'}"


def start(args: list[str], ready_url: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            httpx.get(ready_url, timeout=2)
            return proc
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"nanoserve {args[0]} did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def keep_busy(url: str, stop_flag: threading.Event) -> None:
    """A client that keeps the attached server's engine stepping: one short completion after another."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop_flag.is_set():
            client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hello there, class",
                                                 "max_tokens": 24, "ignore_eos": True})


class Tab:
    """One browser tab's websocket: what it was sent, and keys to send."""

    def __init__(self, ws) -> None:
        self.ws, self.data, self.ready_at = ws, b"", None

    async def read(self, pattern: bytes, t0: float) -> None:
        async for message in self.ws:
            if isinstance(message.data, bytes):
                self.data = (self.data + message.data)[-200_000:]
                if self.ready_at is None and re.search(pattern, self.data):
                    self.ready_at = time.monotonic() - t0


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def measure(url: str, server: psutil.Process, mode: str, n: int, window: float, shared: bool) -> dict:
    ws_url = url.replace("http", "ws") + "/ws?width=160&height=50"
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        tabs = [Tab(await session.ws_connect(ws_url, max_msg_size=0)) for _ in range(n)]
        readers = [asyncio.create_task(tab.read(READY[mode], t0)) for tab in tabs]
        while any(t.ready_at is None for t in tabs):
            if time.monotonic() - t0 > 600:
                raise SystemExit(f"{mode}: not every tab was ready after 600 s")
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)                                # let the first screens settle
        procs = [server, *server.children(recursive=True)]
        apps = [p for p in procs[1:] if "python" in p.name()]
        uss = sum(p.memory_full_info().uss for p in apps) / n         # per tab (shared: one app for all)
        rss = sum(p.memory_info().rss for p in apps) / n
        c0 = cpu_seconds(procs)
        await asyncio.sleep(window)
        idle = (cpu_seconds(procs) - c0) / window
        c0, t_active = cpu_seconds(procs), time.monotonic()
        while time.monotonic() - t_active < window:
            if mode != "attach":
                for tab in tabs[:1] if shared else tabs:         # shared: the teacher steps, the class watches
                    await tab.ws.send_json(["stdin", " "])   # the space key: one step
            await asyncio.sleep(0.5)
        active = (cpu_seconds(procs) - c0) / window
        for tab in tabs:
            await tab.ws.close()
        for r in readers:
            r.cancel()
    ready = sorted(t.ready_at for t in tabs)
    return {"ready": statistics.median(ready), "slowest": ready[-1], "uss": uss, "rss": rss,
            "idle": idle, "active": active, "apps": len(apps)}


def record_traces(folder: Path) -> tuple[Path, Path]:
    a, b = folder / "a.jsonl", folder / "b.jsonl"
    subprocess.run([sys.executable, "-m", "nanoserve", "compare", "--scenario", "memory-pressure", "--set",
                    "preemption_mode=swap", "--save", str(folder / "run")], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (folder / "run-a.jsonl").rename(a)
    (folder / "run-b.jsonl").rename(b)
    return a, b


def run_mode(mode: str, counts: list[int], traces: tuple[Path, Path], window: float, step_delay: float,
             shared: bool) -> None:
    serve = busy = None
    flags = {"replay": ["--replay", str(traces[0])], "compare": ["--compare", *map(str, traces)],
             "live": ["--model", "tiny-llama"], "attach": []}[mode]
    if mode == "attach":
        port = free_port()
        serve = start(["serve", "--model", "tiny-llama", "--port", str(port), "--step-delay", str(step_delay),
                       "--threads", "1"], f"http://127.0.0.1:{port}/health")
        flags = ["--attach", f"http://127.0.0.1:{port}"]
        stop_flag = threading.Event()
        busy = threading.Thread(target=keep_busy, args=(f"http://127.0.0.1:{port}", stop_flag), daemon=True)
        busy.start()
    try:
        for n in counts:
            port = free_port()
            web = start(["web", *flags, "--port", str(port), "--max-sessions", str(max(counts)),
                         "--shared" if shared else "--no-shared"],
                        f"http://127.0.0.1:{port}/static/css/xterm.css")
            try:
                r = asyncio.run(measure(f"http://127.0.0.1:{port}", psutil.Process(web.pid), mode, n, window,
                                        shared))
            finally:
                stop(web)
            by_memory = int(LAPTOP_TAB_MEMORY // r["uss"])
            per_tab = max(r["active"] / n, 1e-3)
            by_cpu = int(LAPTOP_CORES / per_tab)
            print(f"{mode + (' shared' if shared else ''):15s} {n:4d} {r['ready']:7.1f} {r['slowest']:8.1f} {r['uss'] / 1e6:8.0f} "
                  f"{r['rss'] / 1e6:8.0f} {r['idle']:6.2f} {r['active']:7.2f}   {by_memory:6d} {by_cpu:6d}", flush=True)
    finally:
        if busy is not None:
            stop_flag.set()
        if serve is not None:
            stop(serve)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="replay,compare,attach,live")
    ap.add_argument("--tabs", default=None, help="tab counts (default: 1,4,8,16; live: 1,2,4)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of each idle and active measurement")
    ap.add_argument("--step-delay", type=float, default=0.5, help="attach: the server's --step-delay (default: 0.5)")
    ap.add_argument("--shared", action="store_true", help="one app for every tab (default: one app per tab)")
    args = ap.parse_args()
    print(machine())
    print(f"load average now: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared machine: CPU figures "
          "and start times are noisy)")
    print(f"{'mode':15s} {'tabs':>4s} {'ready s':>7s} {'slowest':>8s} {'USS MB':>8s} {'RSS MB':>8s} {'idle':>6s} "
          f"{'active':>7s}   tabs a 2-core 8 GB laptop holds: by memory, by CPU")
    with tempfile.TemporaryDirectory() as tmp:
        traces = record_traces(Path(tmp))
        for mode in args.modes.split(","):
            counts = [int(c) for c in (args.tabs or ("1,2,4" if mode == "live" else "1,4,8,16")).split(",")]
            run_mode(mode, counts, traces, args.window, args.step_delay, args.shared)


if __name__ == "__main__":
    main()
