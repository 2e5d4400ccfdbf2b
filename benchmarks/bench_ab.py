"""A/B throughput of two nanoserve source trees on the same workload, runs interleaved.

    python benchmarks/bench_ab.py --a /work/main --b .            # SmolLM2, 16 requests, 5 rounds
    python benchmarks/bench_ab.py --a /work/main --b . --model tiny-gemma3 --rounds 3

Each run is a fresh process with PYTHONPATH set to its tree (so each imports its own
nanoserve), one torch thread, the same seeded workload: N requests of 64-256 random
prompt tokens and 64 output tokens, greedy, EOS ignored, all added at once and stepped
until done. A and B alternate (A B A B ...), so a machine that slows down during the
run slows both. It prints the CPU and its vector flags, every run's output tokens per
second of wall clock and of process CPU time, the medians, and B/A. The two trees must
give the same tokens (checked): a speed-up that changes the output is not one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, random, sys, time
import torch
torch.set_num_threads(1)
from nanoserve import EngineConfig, LLMEngine, SamplingParams
model, n = sys.argv[1], int(sys.argv[2])
engine = LLMEngine(EngineConfig(model=model, block_size=16, max_num_batched_tokens=512))
rng = random.Random(0)
vocab = engine.vocab_size
prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
engine.add_request("warm", prompts[0][:32], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()
for i, p in enumerate(prompts):
    engine.add_request(str(i), p, params)
out = {}
t0, c0 = time.perf_counter(), time.process_time()
while engine.has_unfinished_requests():
    for o in engine.step().outputs:
        if o.finished:
            out[o.request_id] = o.outputs[0].token_ids
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
tokens = sum(len(t) for t in out.values())
print(json.dumps({"wall": tokens / wall, "cpu": tokens / cpu, "tokens": [out[str(i)] for i in range(n)]}))
"""


def cpu_line() -> str:
    """The CPU model and its vector flags (from /proc/cpuinfo where there is one)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vector = [f for f in flags if f.startswith(("avx", "fma", "amx", "sse4"))]
    return f"{name} · {os.cpu_count()} cores · {' '.join(sorted(vector))}"


def run(tree: Path, model: str, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", WORKER, model, str(n)], capture_output=True, text=True, env=env,
                          cwd=tree, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: the run failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="the baseline tree")
    parser.add_argument("--b", type=Path, required=True, help="the tree compared with it")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(cpu_line())
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, tree in (("A", args.a), ("B", args.b)):
            res = run(tree, args.model, args.num_requests)
            results[name].append(res)
            print(f"round {r + 1} {name}: {res['wall']:.1f} tok/s wall, {res['cpu']:.1f} tok/s CPU", flush=True)
    same = all(x["tokens"] == results["A"][0]["tokens"] for x in results["A"] + results["B"])
    for key in ("wall", "cpu"):
        a = statistics.median(x[key] for x in results["A"])
        b = statistics.median(x[key] for x in results["B"])
        spread = {n: (min(x[key] for x in results[n]), max(x[key] for x in results[n])) for n in results}
        print(f"{key:4s}: A {a:.1f} ({spread['A'][0]:.1f}-{spread['A'][1]:.1f}), "
              f"B {b:.1f} ({spread['B'][0]:.1f}-{spread['B'][1]:.1f}) tok/s; B/A = {b / a:.3f}")
    print(f"same tokens in every run: {same}")
    if not same:
        raise SystemExit("the trees gave different tokens")


if __name__ == "__main__":
    main()
