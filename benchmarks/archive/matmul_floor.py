"""How close is a run to its matmul floor? The workload's own matmuls, replayed alone, against the whole run.

    python benchmarks/archive/matmul_floor.py                  # SmolLM2-135M, float32, bench_throughput's workload
    python benchmarks/archive/matmul_floor.py --threads 1

On a CPU a small model's serving time is mostly matmuls. This script runs
bench_throughput.py's workload once through the engine (fast paths on, the
default) and records every linear layer call: which layer, how many rows.
Then it calls the same layers on random rows of the same sizes, in the same
order, with nothing else in between: the time no engine built on these
matmuls (nanoserve's own panel matmul, cpu/matmul.c, or torch's
oneDNN-packed linears where that is not built) can go below on this
schedule. What the run takes above that floor is everything else:
attention, norms, RoPE, sampling, scheduling, Python.

It prints the run, the matmuls inside it and the replay, split into calls of
more than 32 rows (steps with a prompt chunk) and the rest (decode steps, and
every LM head call: it sees only the rows that sample), with the GFLOP/s of
each. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # benchmarks/
from bench_throughput import nanoserve_run, workload  # noqa: E402

from nanoserve.cpu import linear as cpu_linear  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402

DECODE_ROWS = 32     # a call of at most this many rows is decode-sized here (32 seats)


def record_linears():
    """Patch the CPU linears' forward (PanelLinear, CpuLinear) to log (layer, rows, seconds) per call.

    Returns the log and an undo function."""
    calls: list[tuple[torch.nn.Module, int, float]] = []
    originals = {cls: cls.forward for cls in (cpu_linear.PanelLinear, cpu_linear.CpuLinear)}

    def timed(forward):
        def call(self, x):
            t = time.perf_counter()
            y = forward(self, x)
            calls.append((self, x.shape[0], time.perf_counter() - t))
            return y
        return call

    for cls, forward in originals.items():
        cls.forward = timed(forward)

    def undo():
        for cls, forward in originals.items():
            cls.forward = forward

    return calls, undo


def replay(calls) -> list[float]:
    """The same layers on random rows of the same sizes, in the same order: seconds per call."""
    inputs = {}
    for layer, rows, _ in calls:
        key = (layer.in_features, rows)
        if key not in inputs:
            inputs[key] = torch.randn(rows, layer.in_features)
    times = []
    with torch.inference_mode():
        for layer, rows, _ in calls:
            x = inputs[(layer.in_features, rows)]
            t = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="the token budget per step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    # float32: the CPU Llama path, whose packed linears are what gets recorded and replayed.
    loaded = load_model(args.model, torch.float32, seed=0)
    reqs = workload(args.num_requests, loaded.model.lm_head.out_features, args.seed)   # the vocabulary
    config = dict(model=args.model, dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens)
    nanoserve_run(loaded, [(p, 4) for p, _ in reqs[:4]], config)       # warm-up: builds, packs, first calls

    calls, undo = record_linears()
    try:
        (wall, _), _, steps = nanoserve_run(loaded, reqs, config)
    finally:
        undo()
    replayed = replay(calls)

    sums = defaultdict(float)
    for (layer, rows, inside), alone in zip(calls, replayed):
        kind = "prefill" if rows > DECODE_ROWS else "decode"
        flop = 2 * rows * layer.in_features * layer.out_features
        sums[kind, "inside"] += inside
        sums[kind, "alone"] += alone
        sums[kind, "flop"] += flop
    inside, alone = sum(c[2] for c in calls), sum(replayed)

    print(f"model {args.model}, float32, {args.threads} threads, {len(reqs)} requests, budget "
          f"{args.max_num_batched_tokens} tokens, {steps} steps, {len(calls)} linear calls")
    print(f"  the whole run                     {wall:7.2f} s")
    print(f"  its matmuls, timed in the run     {inside:7.2f} s")
    print(f"  the same matmuls replayed alone   {alone:7.2f} s   (the floor)")
    print(f"  the run above the floor           {wall - alone:7.2f} s   ({(wall - alone) / wall:.0%} of the run)")
    for kind in ("prefill", "decode"):      # over 32 rows / at most 32 rows
        if not sums[kind, "flop"]:
            continue                         # e.g. no prompt longer than 32 tokens
        gflop = sums[kind, "flop"] / 1e9
        print(f"    {kind:8s} calls: in the run {sums[kind, 'inside']:6.2f} s ({gflop / sums[kind, 'inside']:5.1f} "
              f"GFLOP/s), alone {sums[kind, 'alone']:6.2f} s ({gflop / sums[kind, 'alone']:5.1f} GFLOP/s), "
              f"{gflop:6.1f} GFLOP")


if __name__ == "__main__":
    main()
