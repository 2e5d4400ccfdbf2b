"""Decode attention of one layer: the torch backend's plain path, its grouped torch path, and the C kernel.

    python benchmarks/bench_decode_attention.py                  # SmolLM2-135M's geometry, float32
    python benchmarks/bench_decode_attention.py --dtype bfloat16 # + float32 math on a bf16 cache

A batch of B decoding sequences with random lengths, their blocks scattered
over a pool of 1024 blocks of 16 tokens, 9 query heads over 3 KV heads of 64
dims (SmolLM2-135M). Both paths go through the backend's `prepare` and
`forward` exactly as the runner calls them: plain (one padded gather), groups
(the fast path without the C kernel, `cpu_kernel=False`) and C (the fast
path's kernels/cpu_decode.c). The script checks they agree and prints the CPU
time of this thread per call (median of 7).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nanoserve.attention import BatchLayout, paged_attention
from nanoserve.kernels import cpu_decode
from nanoserve.kernels.torch_backend import TorchBackend, cpu_has_bf16_units


def cpu_ms(fn, repeat: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d, n_blocks = 16, 9, 3, 64, 1024
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, d, generator=gen).to(dtype)
    upcast = torch.float32 if dtype == torch.bfloat16 and not cpu_has_bf16_units() else None
    print(f"{args.dtype}, one layer, {hq} query / {hkv} KV heads of {d}, block {bs}, CPU ms per call "
          f"(groups and C multiply in {upcast or dtype})")
    for batch, lo, hi in ((32, 60, 380), (32, 300, 380), (8, 60, 380), (32, 20, 1000)):
        lens = sorted((rng.randint(lo, hi) for _ in range(batch)), reverse=True)   # the runner's order
        free = list(range(n_blocks))
        rng.shuffle(free)
        tables = []
        for L in lens:
            nb = -(-L // bs)
            tables.append(free[:nb])
            free = free[nb:] if len(free) > nb + 40 else list(range(n_blocks))
        slots = torch.tensor([t[(L - 1) // bs] * bs + (L - 1) % bs for t, L in zip(tables, lens)])
        layout = BatchLayout(bs, slots, lens, tables)
        q = torch.randn(batch, hq, d, generator=gen).to(dtype)
        k = torch.randn(batch, hkv, d, generator=gen).to(dtype)
        v = torch.randn(batch, hkv, d, generator=gen).to(dtype)
        results = {}
        with_c = TorchBackend(fast=True, compute_dtype=upcast)
        with_c.decode_kernel = cpu_decode.load(dtype)
        for name, backend in (("plain", TorchBackend(fast=False)),
                              ("groups", TorchBackend(fast=True, compute_dtype=upcast)), ("C", with_c)):
            meta = backend.prepare(layout)
            out = paged_attention(q, k, v, k_cache, v_cache, meta, d**-0.5)
            ms = cpu_ms(lambda: paged_attention(q, k, v, k_cache, v_cache, meta, d**-0.5))
            results[name] = (out, ms)
        for name in ("groups", "C"):
            torch.testing.assert_close(results[name][0].float(), results["plain"][0].float(),
                                       atol=2e-2 if upcast else 1e-5, rtol=0)
        (_, plain), (_, groups), (_, c) = results["plain"], results["groups"], results["C"]
        print(f"  B={batch:3d}, lengths {lo}-{hi}: plain {plain:7.2f} ms, groups {groups:7.2f} ms, "
              f"C {c:7.2f} ms ({plain / c:.1f}x plain, {groups / c:.1f}x groups)")

if __name__ == "__main__":
    main()
