"""The engine's shape grid for the Triton kernels, compiled for real GPU targets: which shapes, and the run.

    python -m nanoserve.kernels.triton_shapes            # every kernel x shape x target, one JSON line each
    python -m nanoserve.kernels.triton_shapes --full     # the full product of the axes below (slower)

The axes are the shapes real models give the kernels: head_dim 64 (SmolLM2,
Llama-3.2-1B), 80 (Phi-2, StableLM), 128 (Llama-3-8B, Qwen, Mistral); GQA ratios 1, 3
(SmolLM2), 4 (Llama-3-8B), 8 (Llama-3-70B); fp16, bf16 and fp32 caches; block sizes 1,
16, 32. Register use depends mostly on the dtype and head_dim (tile sizes), so every
(dtype, head_dim) pair is compiled; the GQA ratio and block size only change masks and
address arithmetic, so `covering_rows` pairs every value of every axis with every
value of every other axis (12 rows, not 108), plus EXTRA_ROWS, shapes the full product
once caught spilling. `--full` compiles the whole product.

For each row the real wrappers are called on small CPU tensors inside
`capture_launches` (triton_targets.py): whatever tile sizes, warp counts and split
counts the wrappers choose for that shape is what gets compiled. Decode is called
with a context of one split and one of 16, so the split-combine kernel runs too.
The lab's fold kernel and the lab's kernels (built around triton_common's step,
as `nanoserve lab triton-decode` builds them) are compiled too.

This module imports Triton for real: it runs in its own process, never under
TRITON_INTERPRET=1 (the tests start it with `python -m`, without that variable).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 80, 128)
GROUPS = (1, 3, 4, 8)          # query heads per KV head
BLOCK_SIZES = (1, 16, 32)
KV_HEADS = (2, 8)              # KV heads per layer: tiny-llama's 2, Llama-3's 8 (store_kv loads them all)
SPLIT_CONTEXTS = (200, 4000)   # decode contexts of 1 split and of 16 (one split per 256 positions)


@dataclass(frozen=True, slots=True)
class Row:
    """One point of the shape grid."""
    dtype: str
    head_dim: int
    group: int
    block_size: int
    kv_heads: int


# Shapes the full product found fragile, compiled in CI too: with 2 pipeline stages ptxas spilled
# 4 bytes of this float32 decode program on sm_90 (triton_decode.py keeps 3 stages for float32).
EXTRA_ROWS = [Row("float32", 64, 1, 16, 2)]


def covering_rows() -> list[Row]:
    """12 rows in which every pair of values of any two axes appears at least once, and EXTRA_ROWS.

    Rows (i, j) for group index i < 4 and block-size index j < 3 take dtype (i + j) % 3 and
    head_dim (i + 2j) % 3: for i < 3 the map (i, j) -> (i + j, i + 2j) mod 3 is one to one, so
    all 9 (dtype, head_dim) pairs appear; for a fixed i or j each of the two runs through all 3.
    """
    return [Row(DTYPES[(i + j) % 3], HEAD_DIMS[(i + 2 * j) % 3], GROUPS[i], BLOCK_SIZES[j], KV_HEADS[(i + j) % 2])
            for i, j in itertools.product(range(len(GROUPS)), range(len(BLOCK_SIZES)))] + EXTRA_ROWS


def full_rows() -> list[Row]:
    return [Row(*r) for r in itertools.product(DTYPES, HEAD_DIMS, GROUPS, BLOCK_SIZES, KV_HEADS[:1])]


def run_wrappers(row: Row) -> None:
    """Call every Triton wrapper the engine uses at this row's shape (inside capture_launches nothing runs)."""
    import torch

    from nanoserve.kernels import triton_cache, triton_decode, triton_prefill

    dt, bs, hkv, d = getattr(torch, row.dtype), row.block_size, row.kv_heads, row.head_dim
    hq = hkv * row.group
    k_cache = torch.zeros(4, bs, hkv, d, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    for ctx in SPLIT_CONTEXTS:                 # batch of 3: the longest sets the block-table width
        tables = torch.zeros(3, -(-ctx // bs), dtype=torch.int64)
        triton_decode.decode_attention(torch.zeros(3, hq, d, dtype=dt), k_cache, v_cache, tables,
                                       torch.tensor([ctx, 7, 1]), 0.1)
    # Two chunks: 37 new tokens after a cached prefix of 60, and a fresh 5-token prompt.
    tables = torch.zeros(2, -(-97 // bs), dtype=torch.int64)
    triton_prefill.prefill_attention(torch.zeros(42, hq, d, dtype=dt), k_cache, v_cache, tables,
                                     torch.tensor([0, 37]), torch.tensor([37, 5]), torch.tensor([97, 5]), 0.1)
    triton_cache.store_kv(torch.zeros(42, hkv, d, dtype=dt), torch.zeros(42, hkv, d, dtype=dt), k_cache, v_cache,
                          torch.arange(42) % (4 * bs))
    triton_cache.copy_blocks([k_cache, v_cache], torch.tensor([0, 1]), torch.tensor([2, 3]))


def run_lab_kernels(row: Row) -> None:
    """The triton-decode lab's fold kernel on its own tile shapes, and its kernels built around triton_common
    (with the engine's tiles, and with the 16-position tiles and 4 splits its checks ask for)."""
    import torch

    from nanoserve.kernels import triton_common
    from nanoserve.labs import triton_kernels

    s, v = torch.zeros(2, 16, 16), torch.zeros(2, 16, 16)      # the shapes the lab's masked-tile check uses
    probe = triton_kernels._kernels(triton_common)
    probe.fold_kernel[(1,)](s, v, torch.empty(16, 16), TILES=2, R=16, N=16, D=16)
    m = torch.zeros(16)
    probe.step_kernel[(1,)](m, m, s[0], s[0], v[0], m, m, s[0], R=16, N=16, D=16)
    decode, prefill = triton_kernels.build(triton_common)
    dt, bs, d = getattr(torch, row.dtype), row.block_size, row.head_dim
    k_cache = torch.zeros(4, bs, row.kv_heads, d, dtype=dt)
    tables = torch.zeros(2, -(-40 // bs), dtype=torch.int64)
    q = torch.zeros(2, row.kv_heads * row.group, d, dtype=dt)
    decode.decode_attention(q, k_cache, k_cache, tables, torch.tensor([40, 3]), 0.1)
    decode.decode_attention(q, k_cache, k_cache, tables, torch.tensor([40, 3]), 0.1, num_splits=4, block_n=16)
    prefill.prefill_attention(q, k_cache, k_cache, tables, torch.tensor([0, 1]), torch.tensor([1, 1]),
                              torch.tensor([40, 3]), 0.1)


def collect(rows: list[Row], alignments: bool = False):
    """[(launch, row, where)] for every distinct launch the rows make; `where` is "engine" or "lab".

    Triton's launcher also specialises on which integer arguments are multiples of 16 (a
    block-table width) or equal to 1 (a stride with one split): `alignments=True` keeps
    every such variant, the default the first one seen of each kernel, dtypes, constexprs
    and warp count.
    """
    from nanoserve.kernels.triton_targets import capture_launches

    found, seen = [], set()
    for where, run, rows_here in (("engine", run_wrappers, rows), ("lab", run_lab_kernels, rows[:1])):
        for row in rows_here:
            with capture_launches() as launches:
                run(row)
            for launch in launches:
                key = launch.shape_key()
                if alignments:
                    key += (repr(sorted(launch.signature.items())), repr(sorted(launch.constants.items())),
                            repr(sorted(launch.attrs.items())))
                if key not in seen:
                    seen.add(key)
                    found.append((launch, row, where))
    return found


def _data_type(launch) -> str:
    """The kernel's data dtype: its first 16-bit float pointer's, else fp32 (int pointers are indices)."""
    floats = [t[1:] for t in launch.signature.values() if t.startswith("*fp") or t.startswith("*bf")]
    return next((t for t in floats if t != "fp32"), "fp32")


_JOBS: list = []                 # (launch, row, where, target): set before the pool forks, read by workers


def _compile_one(i: int) -> dict:
    from nanoserve.kernels.triton_targets import compile_for, read_resources

    launch, row, where, target = _JOBS[i]
    result = {"kernel": launch.name, "where": where, "target": target.name, "row": asdict(row),
              "constexprs": launch.constexprs(), "num_warps": launch.num_warps,
              "dtype": _data_type(launch)}
    t0 = time.perf_counter()
    try:
        res = read_resources(compile_for(launch, target))
    except Exception as e:                  # a compile error is a result: the tests fail on it by name
        return {**result, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
    return {**result, **asdict(res), "compile_s": round(time.perf_counter() - t0, 2),
            "blocks_per_sm": res.blocks_per_sm(target), "occupancy": res.occupancy(target),
            "shared_limit": target.shared_per_block}


def compile_all(rows: list[Row], targets: list[str], workers: int | None = None, alignments: bool = False,
                kernels: tuple[str, ...] | None = None, launch: tuple[int, int] | None = None):
    """Yield one result dict per (distinct launch, target), compiling in a pool of forked processes.

    `kernels` keeps only those kernels; `launch` = (num_warps, num_stages) replaces the
    wrappers' choice (benchmarks/kernel_resources.py compiles the old launch shape that way).
    """
    from nanoserve.kernels.triton_targets import TARGETS

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreter's kernels cannot be compiled for a GPU")
    found = [(launch_, row, where) for launch_, row, where in collect(rows, alignments)
             if kernels is None or launch_.name in kernels]
    if launch is not None:
        found = [(replace(x, num_warps=launch[0], num_stages=launch[1]), row, where) for x, row, where in found]
    _JOBS[:] = [(launch_, row, where, TARGETS[t]) for launch_, row, where in found for t in targets]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = workers or min(cores, 8)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from pool.imap(_compile_one, range(len(_JOBS)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the full product of the axes instead of the covering rows")
    ap.add_argument("--alignments", action="store_true", help="every alignment variant Triton specialises on")
    ap.add_argument("--targets", default="sm_80,sm_90,sm_100", help="comma-separated, from sm_80, sm_90, sm_100")
    ap.add_argument("--workers", type=int, default=None, help="compiling processes (default: the usable cores)")
    args = ap.parse_args(argv)
    rows = full_rows() if args.full else covering_rows()
    for result in compile_all(rows, args.targets.split(","), args.workers, args.full or args.alignments):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
