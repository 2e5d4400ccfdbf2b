"""The CPU Llama path's matmul (cpu/matmul.c) against oneDNN's packed matmul, per projection.

    python benchmarks/bench_matmul.py                    # SmolLM2-135M's projections, 2 threads
    python benchmarks/bench_matmul.py --threads 1 --rows 1,32
    python benchmarks/bench_matmul.py --threads 1 --dtype bfloat16   # matmul_bf16.c (a CPU with AVX512-BF16)

For each of SmolLM2-135M's matmul shapes (merged q/k/v, o, merged gate/up,
down, the LM head) and each row count, both kernels multiply the same rows by
the same weights: oneDNN through torch (`torch.ops.mkldnn`, a weight reordered
once into its blocked layout, as cpu/linear.py's CpuLinear and vLLM's
CPU backend call it) and nanoserve's 16-column panels (PanelLinear's call).
As in a decode step, the weights come from memory: each call takes the next
of 30 copies (4 of the 113 MB LM head), more than the CPU's caches hold. It
prints GFLOP/s of wall clock, the median of 5 sweeps, and checks that both
agree with each other. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_throughput import machine

from nanoserve.cpu import matmul as cpu_matmul

SHAPES = {      # name: (out_features, in_features) of SmolLM2-135M's matmuls, merged as cpu/llama.py does
    "q/k/v": (960, 576),
    "o": (576, 576),
    "gate/up": (3072, 576),
    "down": (576, 1536),
    "LM head": (49152, 576),
}


def sweep_seconds(call, weights) -> float:
    """Median over 5 sweeps of the seconds per call, each sweep calling once per weight copy."""
    for w in weights:
        call(w)                            # first touch, and page-in of the outputs
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for w in weights:
            call(w)
        times.append((time.perf_counter() - t) / len(weights))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,128,512", help="row counts, comma separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: matmul_bf16.c against oneDNN's packed bf16 matmul (needs AVX512-BF16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    mm = cpu_matmul.load(dtype)
    if mm is None:
        raise SystemExit(f"the {args.dtype} panel matmul could not be built here (no C compiler, or for "
                         "bfloat16 a CPU without AVX512-BF16)")
    rows_list = [int(r) for r in args.rows.split(",") if r]
    print(machine())
    print(f"{args.dtype}, {args.threads} threads; GFLOP/s, weights from memory; oneDNN packed -> nanoserve panels")
    for name, (out_f, in_f) in SHAPES.items():
        copies = 4 if out_f * in_f > 10_000_000 else 30
        dense = [torch.randn(out_f, in_f).to(dtype) for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in dense]
        panels = [mm.pack(w) for w in dense]
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, in_f).to(dtype)
            a = torch.ops.mkldnn._linear_pointwise(x, onednn[0], None, "none", [], "")
            b = mm.linear(x, panels[0], out_f)
            tol = (1e-4, 1e-3) if dtype == torch.float32 else (1.6e-2, 0.1)    # bf16: one rounding of the output
            torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=tol[1])
            t_onednn = sweep_seconds(lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                     onednn)
            t_panel = sweep_seconds(lambda w: mm.linear(x, w, out_f, None, False), panels)
            gflop = 2 * rows * out_f * in_f / 1e9
            cells.append(f"{rows:>4} rows {gflop / t_onednn:5.1f} -> {gflop / t_panel:5.1f} "
                         f"({t_onednn / t_panel:4.2f}x)")
        print(f"  {name:8s} [{out_f} x {in_f}]")
        for cell in cells:
            print(f"      {cell}")


if __name__ == "__main__":
    main()
