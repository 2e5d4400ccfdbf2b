"""What the HTTP server and streaming add per generated token, over the engine alone (bench_serving.py --overhead).

    python benchmarks/bench_serving.py --overhead --threads 1 --repeat 3
    python benchmarks/bench_serving.py --overhead --num-prompts 32 --input-len 256 --output-len 128

The same workload three ways, interleaved, `--repeat` rounds after a warm-up
of each:

    engine     LLMEngine in this process: every request added at once, stepped until done
    HTTP       `nanoserve serve` (a subprocess, the same engine settings), the same requests sent
               at once as non-streaming /v1/completions (token-id prompts, EOS ignored)
    streaming  the same requests with "stream": true: one server-sent event per token

The requests are `--num-prompts` random token-id prompts of `--input-len`
tokens, each generating exactly `--output-len` tokens (greedy); every round
draws new prompts and gives the same ones to all three; before each server
pass the server's prefix cache is emptied (POST /reset_prefix_cache), or the
second pass of a round would skip the prefills the first one cached.

For each way it prints the wall clock and the CPU seconds: this process's
for the engine alone, the server process's (read from /proc, so the client
here is not counted) for the other two. What the server adds per generated
token is the difference to the engine alone, divided by the tokens: by CPU
time (what the server's threads spent: HTTP parsing, JSON, the asyncio
loop, the engine thread's hand-offs; the fair measure when other work shares
the machine) and by wall clock (what a client waits). Linux only (/proc).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx
from servers import free_port, stop, wait_healthy

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads (Linux /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS       # utime, stime (fields 14 and 15)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def engine_pass(loaded, config: dict, reqs: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    from nanoserve import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(**config), loaded=loaded)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(reqs):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step().outputs if o.finished)
    return time.perf_counter() - t0, time.process_time() - c0, tokens


async def _one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool) -> int:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        return resp.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def _send_all(url: str, reqs: list[list[int]], max_tokens: int, stream: bool) -> int:
    limits = httpx.Limits(max_connections=len(reqs) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        return sum(await asyncio.gather(*(_one(client, p, max_tokens, stream) for p in reqs)))


def server_pass(url: str, pid: int, reqs: list[list[int]], max_tokens: int, stream: bool) -> tuple[float, float, int]:
    # the other server pass of this round sent the same prompts: empty the prefix cache first, or this
    # pass would skip their prefills (the engine pass builds a new engine, with an empty cache)
    httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
    t0, c0 = time.perf_counter(), process_cpu_seconds(pid)
    tokens = asyncio.run(_send_all(url, reqs, max_tokens, stream))
    return time.perf_counter() - t0, process_cpu_seconds(pid) - c0, tokens


def run(args) -> None:
    import torch
    from bench_throughput import machine

    from nanoserve.models.loader import load_model

    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}", flush=True)
    config = dict(model="smollm2", dtype=args.dtype, block_size=16, num_blocks=args.num_blocks, max_num_seqs=32,
                  max_num_batched_tokens=512)
    loaded = load_model("smollm2", getattr(torch, args.dtype), seed=0)
    vocab = loaded.model.config.vocab_size
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "smollm2", "--dtype", args.dtype,
           "--num-blocks", str(args.num_blocks), "--max-num-seqs", "32", "--max-batched-tokens", "512",
           "--port", str(port), "--max-waiting", "1024"]
    log = open(f"/tmp/bench_serving_overhead_{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    ways = {"engine": lambda reqs: engine_pass(loaded, config, reqs, args.output_len),
            "HTTP": lambda reqs: server_pass(url, proc.pid, reqs, args.output_len, stream=False),
            "streaming": lambda reqs: server_pass(url, proc.pid, reqs, args.output_len, stream=True)}
    times: dict[str, list[tuple[float, float, int]]] = {w: [] for w in ways}
    try:
        wait_healthy(url, proc, timeout=600)
        print(f"{args.num_prompts} requests of {args.input_len} prompt tokens, {args.output_len} generated each, "
              f"{args.dtype}, {args.threads} thread(s); server pid {proc.pid}", flush=True)
        warm = prompts(4, args.input_len, vocab, args.seed + 10_000)
        for fn in ways.values():
            fn(warm)
        for r in range(args.repeat):
            reqs = prompts(args.num_prompts, args.input_len, vocab, args.seed + r)
            order = list(ways) if r % 2 == 0 else list(ways)[::-1]
            for way in order:
                wall, cpu, tokens = ways[way](reqs)
                times[way].append((wall, cpu, tokens))
                print(f"  [{r + 1}/{args.repeat}] {way:9s} wall {wall:7.2f} s  CPU {cpu:7.2f} s  {tokens} tokens",
                      flush=True)
    finally:
        stop(proc)
    report(times)


def report(times: dict[str, list[tuple[float, float, int]]]) -> None:
    tokens = statistics.median(t for _, _, t in times["engine"])
    wall = {w: statistics.median(x for x, _, _ in v) for w, v in times.items()}
    cpu = {w: statistics.median(c for _, c, _ in v) for w, v in times.items()}
    print(f"\nmedians ({int(tokens)} tokens generated a pass); per token, and what the server adds to the engine:")
    for w in times:
        extra = "" if w == "engine" else (
            f"   adds {1e3 * (cpu[w] - cpu['engine']) / tokens:+.3f} ms CPU/token "
            f"({100 * (cpu[w] / cpu['engine'] - 1):+.1f} %), {1e3 * (wall[w] - wall['engine']) / tokens:+.3f} ms "
            f"wall/token ({100 * (wall[w] / wall['engine'] - 1):+.1f} %)")
        print(f"  {w:9s} wall {wall[w]:7.2f} s ({1e3 * wall[w] / tokens:6.2f} ms/token)  CPU {cpu[w]:7.2f} s "
              f"({1e3 * cpu[w] / tokens:6.2f} ms/token){extra}")
