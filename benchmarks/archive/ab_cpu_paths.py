"""Before/after of the CPU fast path's choices, in one process: each variant against the default, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/archive/ab_cpu_paths.py --dtype bfloat16 bf16-before
    OMP_NUM_THREADS=1 python benchmarks/archive/ab_cpu_paths.py --dtype bfloat16 bf16-onednn
    OMP_NUM_THREADS=1 python benchmarks/archive/ab_cpu_paths.py --dtype float32 panels-8
    OMP_NUM_THREADS=1 python benchmarks/archive/ab_cpu_paths.py --dtype float32 budget-2048

bench_throughput.py's workload (32 requests, SmolLM2-135M, greedy, EOS
ignored) through nanoserve with the default fast path ("now") and with one
choice undone (a variant), in rounds whose order alternates, after one short
warm-up of each. It prints each run's wall and CPU seconds, the medians, the
per-round ratios of CPU time (the fair measure on a machine other work shares)
and how many requests gave the same greedy tokens as "now". The variants:

    bf16-before   bf16 as before the CPU had a bf16 path: the model's own forward, its nn.Linear
                  layers in bf16 (no CpuLlama, no packed bf16 weights)
    bf16-onednn   bf16 matmuls from oneDNN-packed bf16 weights instead of matmul_bf16.c's panels
    panels-8      matmul.c built with 8-float vectors (16-column panels), as on an AVX2 CPU,
                  where this CPU has 16-float ones (AVX-512)
    budget-2048   a 2 048-token budget per step instead of 512 (vLLM's CPU default is 4 096)

Undoing a choice patches `nanoserve.cpu` in this process only (nothing is
written); the numbers are this machine's (it prints the CPU model and flags).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # benchmarks/: bench_throughput's workload
from bench_throughput import machine, nanoserve_run, workload  # noqa: E402

import nanoserve.cpu as fast_path  # noqa: E402
import nanoserve.cpu.llama as cpu_llama  # noqa: E402
from nanoserve.cpu import build  # noqa: E402
from nanoserve.cpu import matmul as cpu_matmul  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402

ORIGINAL = dict(view=fast_path.cpu_llama_view, can_pack_dtype=fast_path.can_pack_dtype, load=cpu_matmul.load)
VARIANTS = {"bf16-before": {}, "bf16-onednn": {}, "panels-8": {}, "budget-2048": {"max_num_batched_tokens": 2048}}


def matmul_8_lanes(dtype: torch.dtype = torch.float32) -> cpu_matmul.CpuMatmul | None:
    if dtype != torch.float32:
        return ORIGINAL["load"](dtype)
    return cpu_matmul.CpuMatmul(ctypes.CDLL(str(build.build(cpu_matmul.SOURCE, build.FLAGS + ["-DVEC_LANES=8"]))))


def no_bf16_panels(dtype: torch.dtype = torch.float32) -> cpu_matmul.CpuMatmul | None:
    return None if dtype == torch.bfloat16 else ORIGINAL["load"](dtype)


def use(variant: str) -> None:
    """Undo `variant`'s choice (or none, for "now") in nanoserve.cpu."""
    before = variant == "bf16-before"
    fast_path.cpu_llama_view = ((lambda m, d=torch.float32: None if d == torch.bfloat16 else ORIGINAL["view"](m, d))
                                if before else ORIGINAL["view"])
    fast_path.can_pack_dtype = ((lambda d: d == torch.float32 and ORIGINAL["can_pack_dtype"](d))
                                if before else ORIGINAL["can_pack_dtype"])
    cpu_llama.cpu_matmul.load = {"panels-8": matmul_8_lanes, "bf16-onednn": no_bf16_panels}.get(variant,
                                                                                             ORIGINAL["load"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each runs every variant once")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}", flush=True)
    loaded = load_model("smollm2", getattr(torch, args.dtype), seed=0)
    reqs = workload(args.num_requests, loaded.model.config.vocab_size, 0)   # as bench_throughput.py draws it
    useful = sum(n for _, n in reqs)
    base = dict(model="smollm2", dtype=args.dtype, block_size=16, num_blocks=1024, max_num_seqs=32,
                max_num_batched_tokens=512)
    names = ["now", *args.variants]
    configs = {n: dict(base, **VARIANTS.get(n, {})) for n in names}
    for n in names:                                  # warm-up: builds, packs, first allocations
        use(n)
        nanoserve_run(loaded, reqs[:8], configs[n])
    cpu: dict[str, list[float]] = {n: [] for n in names}
    outs = {}
    for r in range(args.repeat):
        for n in names if r % 2 == 0 else names[::-1]:
            use(n)
            (wall, seconds), outs[n], _ = nanoserve_run(loaded, reqs, configs[n])
            cpu[n].append(seconds)
            print(f"[{r + 1}/{args.repeat}] {n:12s} wall {wall:6.1f} s  CPU {seconds:6.2f} s  "
                  f"{useful / seconds:6.1f} tok/CPU-s", flush=True)
    use("now")
    print(f"\n{args.dtype}, CPU seconds (median, spread); 'now' is how many times faster than each variant:")
    for n in names:
        ratios = [v / c for c, v in zip(cpu["now"], cpu[n])]
        same = sum(a == b for a, b in zip(outs["now"], outs[n]))
        print(f"  {n:12s} {statistics.median(cpu[n]):6.2f} s ({min(cpu[n]):.2f}-{max(cpu[n]):.2f})  "
              f"now is {statistics.median(cpu[n]) / statistics.median(cpu['now']):.3f}x "
              f"(per round {min(ratios):.2f}-{max(ratios):.2f}); greedy same as now {same}/{len(reqs)}")


if __name__ == "__main__":
    main()
