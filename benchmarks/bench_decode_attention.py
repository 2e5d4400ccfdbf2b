"""Attention of one layer on a CPU: the torch backend's plain path, its grouped torch path, and the C kernel.

    python benchmarks/bench_decode_attention.py                  # SmolLM2-135M's geometry, float32
    python benchmarks/bench_decode_attention.py --dtype bfloat16 # + float32 math on a bf16 cache

A batch of B decoding sequences with random lengths, their blocks scattered
over a pool of 1024 blocks of 16 tokens, 9 query heads over 3 KV heads of 64
dims (SmolLM2-135M). All paths go through the backend's `prepare` and
`forward` exactly as the runner calls them: plain (one padded gather), groups
(the fast path without the C kernel, `path="torch"`) and C (the fast
path's cpu/attention.c). Then single prefill chunks (no cached prefix,
and one after 256 cached tokens): the torch path (gather, masked SDPA) against
the C kernel given one row per query. The script checks the paths agree and
prints the CPU time of this thread per call (median of 7).

Last, a whole step: the C kernel over 30 layers, each with its own pool, so
that K/V come from memory as in the engine (one layer's pool, read seven
times over, stays in the CPU's caches). It runs attention.c as built and with
its two memory choices undone (-DHEADS_PER_PASS=1: one query head per pass
over K and V; -DAHEAD=0: no fetching ahead), interleaved in rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_throughput import machine

from nanoserve.attention import BatchLayout, PrefillChunk, paged_attention
from nanoserve.cpu import attention as cpu_decode
from nanoserve.cpu.backend import CpuBackend
from nanoserve.cpu.linear import cpu_has_bf16_units
from nanoserve.kernels.torch_backend import TorchBackend


def cpu_ms(fn, repeat: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def scattered_tables(rng: random.Random, lens: list[int], bs: int, n_blocks: int) -> list[list[int]]:
    """A block table per sequence, its blocks drawn from a shuffled pool (reused when it runs low)."""
    free = list(range(n_blocks))
    rng.shuffle(free)
    tables = []
    for L in lens:
        nb = -(-L // bs)
        tables.append(free[:nb])
        free = free[nb:] if len(free) > nb + 40 else list(range(n_blocks))
    return tables


def compare(paths: dict[str, TorchBackend], layout: BatchLayout, q, k, v, k_cache, v_cache, atol: float) -> dict:
    """Each path's CPU ms per call of the layer's attention on this batch; checks they agree with the first."""
    results = {}
    for name, backend in paths.items():
        meta = backend.prepare(layout)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5)
        ms = cpu_ms(lambda: paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5))
        results[name] = (out, ms)
    first = next(iter(results.values()))[0]
    for out, _ in results.values():
        torch.testing.assert_close(out.float(), first.float(), atol=atol, rtol=0)
    return {name: ms for name, (_, ms) in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d, n_blocks = 16, 9, 3, 64, 1024
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, d, generator=gen).to(dtype)
    upcast = torch.float32 if dtype == torch.bfloat16 and not cpu_has_bf16_units() else None
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5     # bf16 outputs: rounded after sums in other orders
    with_c = CpuBackend(cpu_decode.load(dtype), cpu_decode.load_store(dtype))   # nanoserve/cpu/'s backend
    paths = {"plain": TorchBackend(grouped=False), "groups": TorchBackend(grouped=True, compute_dtype=upcast), "C": with_c}
    print(f"{args.dtype}, one layer, {hq} query / {hkv} KV heads of {d}, block {bs}, CPU ms per call "
          f"(groups and C multiply in {upcast or dtype})")
    print("decodes:")
    for batch, lo, hi in ((32, 60, 380), (32, 300, 380), (8, 60, 380), (32, 20, 1000)):
        lens = sorted((rng.randint(lo, hi) for _ in range(batch)), reverse=True)   # the runner's order
        tables = scattered_tables(rng, lens, bs, n_blocks)
        slots = torch.tensor([t[(L - 1) // bs] * bs + (L - 1) % bs for t, L in zip(tables, lens)])
        layout = BatchLayout(bs, slots, lens, tables)
        q = torch.randn(batch, hq, d, generator=gen).to(dtype)
        k = torch.randn(batch, hkv, d, generator=gen).to(dtype)
        v = torch.randn(batch, hkv, d, generator=gen).to(dtype)
        ms = compare(paths, layout, q, k, v, k_cache, v_cache, atol)
        plain, groups, c = ms["plain"], ms["groups"], ms["C"]
        print(f"  B={batch:3d}, lengths {lo}-{hi}: plain {plain:7.2f} ms, groups {groups:7.2f} ms, "
              f"C {c:7.2f} ms ({plain / c:.1f}x plain, {groups / c:.1f}x groups)")
    # A prefill chunk: the torch paths gather its blocks and call SDPA with a causal mask; the C path gives
    # the kernel one row per query, each over its causal prefix (cpu/backend.py).
    print("one prefill chunk (torch paths: gather + masked SDPA; C: a row per query):")
    for cached, chunk in ((0, 64), (0, 136), (0, 256), (256, 128)):
        ctx = cached + chunk
        (table,) = scattered_tables(rng, [ctx], bs, n_blocks)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached, ctx)])
        layout = BatchLayout(bs, slots, [], [], [PrefillChunk(0, chunk, ctx, table)])
        q = torch.randn(chunk, hq, d, generator=gen).to(dtype)
        k = torch.randn(chunk, hkv, d, generator=gen).to(dtype)
        v = torch.randn(chunk, hkv, d, generator=gen).to(dtype)
        ms = compare({"torch": paths["groups"], "C": with_c}, layout, q, k, v, k_cache, v_cache, atol)
        print(f"  {chunk:4d} queries after {cached:3d} cached tokens: torch {ms['torch']:7.2f} ms, "
              f"C {ms['C']:7.2f} ms ({ms['torch'] / ms['C']:.1f}x)")
    whole_step(dtype, gen, rng, atol)


UNDONE = {"now": (), "one head per pass": ("-DHEADS_PER_PASS=1",), "no fetch ahead": ("-DAHEAD=0",),
          "neither": ("-DHEADS_PER_PASS=1", "-DAHEAD=0")}


def whole_step(dtype: torch.dtype, gen: torch.Generator, rng: random.Random, atol: float, layers: int = 30,
               batch: int = 32, rounds: int = 9) -> None:
    """The C kernel over a decode step's layers, each its own pool: CPU ms per step, per build of attention.c."""
    bs, hq, hkv, d, n_blocks = 16, 9, 3, 64, 1024
    pools = [[torch.randn(n_blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)] for _ in range(layers)]
    lens = [rng.randint(100, 300) for _ in range(batch)]
    tables = scattered_tables(rng, lens, bs, n_blocks)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype)
    kernels = {name: cpu_decode.load(dtype, flags) for name, flags in UNDONE.items()}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    outs = {}
    for r in range(rounds + 1):                      # round 0 warms up
        for name, kernel in (kernels.items() if r % 2 else reversed(kernels.items())):
            t0 = time.thread_time()
            for k_cache, v_cache in pools:
                outs[name] = kernel(q, k_cache, v_cache, block_tables, seq_lens, d**-0.5)
            if r:
                times[name].append(time.thread_time() - t0)
    for out in outs.values():                        # the last layer's output, the same from every build
        torch.testing.assert_close(out.float(), outs["now"].float(), atol=atol, rtol=0)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"a whole step: {layers} layers, each its own pool (K/V read from memory), B={batch}, lengths 100-300; "
          f"CPU ms per step (median of {rounds}):")
    for name, value in ms.items():
        print(f"  {name:18s} {value:7.2f} ms" + ("" if name == "now" else f"  (now is {value / ms['now']:.2f}x faster)"))


if __name__ == "__main__":
    main()
