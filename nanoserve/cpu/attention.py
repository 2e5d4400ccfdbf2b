"""Paged attention on the CPU in a small C kernel (attention.c): build it, load it, call it.

The torch backend's decode path gathers every sequence's blocks into a copy
before torch's attention can read them (kernels/reference.py). On a CPU that
copy is most of the cost: the K/V bytes are written once more and read
twice. `attention.c` reads them once, in place, through the block table.
It attends one query per row, each with its own table and length, so the
CPU backend (cpu/backend.py) gives it prefill rows too (each a decode over
its causal prefix); its second function stores a step's new K/V rows at
their slots.

It is compiled on first use and cached (cpu/build.py). Without a
compiler, or if the build fails, `load()` warns once and returns None, and
the engine runs the torch backend instead: the same numbers, a little
slower. `EngineConfig(path="torch")` never builds it.

    decode = load(torch.float32)            # None if it cannot be built here
    out = decode(q, k_cache, v_cache, block_tables, seq_lens, scale)   # [B, Hq, D]
    out = decode(..., scale, window=W)      # a sliding-window layer: each row's last W tokens only

    store = load_store(torch.float32)       # the same library's store: new K/V rows to their slots
    store(k, v, k_cache, v_cache, slot_mapping)                         # as reference.store_kv

It links OpenMP (libgomp, the runtime torch's CPU build uses too), so it
runs on as many threads as `torch.set_num_threads` gives torch.
"""

from __future__ import annotations

import ctypes
from functools import cache, partial
from pathlib import Path

import torch

from nanoserve.cpu.build import FLAGS, load_library
from nanoserve.kernels.checks import CheckedLayouts, check_cache, check_int_vector, check_paged_args, expect

SOURCE = Path(__file__).with_name("attention.c")
# No errno and no floating-point traps to keep: lets the compiler vectorise the softmax's exp and maxima.
DECODE_FLAGS = [*FLAGS, "-fno-math-errno", "-fno-trapping-math"]
NO_MEMORY, BAD_SEQ_LEN, BAD_BLOCK = -1, -2, -3    # what the C function returns instead of 0 (OK)
CACHE_DTYPES = {torch.float32: [], torch.bfloat16: ["-DCACHE_BF16"]}   # extra flags per cache dtype


@cache
def library(cache_dtype: torch.dtype, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """attention.c built for a cache of `cache_dtype`, or None (with one warning) if unavailable.

    `extra`: more compiler flags, e.g. ("-DVEC_LANES=8",) for the 8-float layout an AVX2 CPU runs (the tests
    check that one on an AVX-512 CPU too)."""
    if cache_dtype not in CACHE_DTYPES:
        return None
    return load_library(SOURCE, DECODE_FLAGS + CACHE_DTYPES[cache_dtype] + list(extra), "the CPU attention kernel",
                        "attention takes the torch path (same results, slower)")


def c_function(cache_dtype: torch.dtype, name: str, argtypes: list, extra: tuple[str, ...] = ()):
    """The library's function `name` (returning an int status) with its argument types, or None without it."""
    lib = library(cache_dtype, extra)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


@cache
def load(cache_dtype: torch.dtype, extra: tuple[str, ...] = ()):
    """The kernel for a cache of `cache_dtype` as a Python function, or None (with one warning) if unavailable."""
    fn = c_function(cache_dtype, "paged_decode_attention",
                    [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int64], extra)
    if fn is None:
        return None
    check = partial(check_layout, cache_dtype=cache_dtype)     # this build's cache dtype
    layouts = CheckedLayouts()

    def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0) -> torch.Tensor:
        """q [B, Hq, D], caches [N, bs, Hkv, D], block_tables [B, nb] int64, seq_lens [B] int64 -> [B, Hq, D].

        `window` > 0: each row attends only to its last `window` tokens (a sliding-window layer)."""
        # The C code trusts shapes and dtypes; a wrong one would read the wrong memory, so check them all
        # (a ValueError naming the argument, as every kernel wrapper raises: kernels/checks.py). Every layer
        # of a step passes the same layout, so the checks run when it changes: about once a step.
        block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        layouts.check("decode", check, q, k_cache, v_cache, block_tables, seq_lens)
        B, Hq, D = q.shape
        N, bs, Hkv, _ = k_cache.shape
        # q (the cache's dtype: checked) may be rows of a wider tensor (the merged q/k/v matmul output): the
        # kernel takes their stride. It computes in float32 and writes `out` in q's dtype.
        q = q if q.stride(2) == 1 and q.stride(1) == D else q.contiguous()
        out = torch.empty(B, Hq, D, dtype=q.dtype)
        status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                    seq_lens.data_ptr(), out.data_ptr(), B, Hq, Hkv, D, bs, block_tables.shape[1], N,
                    q.stride(0), scale, window)
        if status != 0:     # the C code checks every length and block id it would follow, before reading any
            expect(status != BAD_SEQ_LEN, "seq_lens", f"lengths from 1 to {block_tables.shape[1] * bs} (what "
                   "the tables hold)", seq_lens)
            expect(status != BAD_BLOCK, "block_tables", f"block ids below the pool's {N}", block_tables)
            raise MemoryError("the CPU decode kernel could not allocate its scratch buffers")
        return out

    return decode_attention


def check_layout(q, k_cache, v_cache, block_tables, seq_lens, *, cache_dtype: torch.dtype) -> None:
    """Shapes, dtypes, devices and strides the C code relies on (the values are checked in C)."""
    check_paged_args(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    B = q.shape[0]
    check_build_cache(k_cache, v_cache, cache_dtype)
    expect(block_tables.dtype == seq_lens.dtype == torch.int64 and block_tables.shape[0] == B == len(seq_lens),
           "block_tables", f"int64 tables and lengths for the {B} queries", block_tables)


@cache
def load_store(cache_dtype: torch.dtype):
    """`reference.store_kv` in one C call (attention.c's paged_store_kv), or None where the library is not."""
    fn = c_function(cache_dtype, "paged_store_kv",
                    [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3)
    if fn is None:
        return None
    check = partial(check_store_layout, cache_dtype=cache_dtype)
    layouts = CheckedLayouts()

    def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
        """k_cache.flat[slot_mapping[t]] = k[t] (and the same for v); k, v [T, Hkv, D] rows of any stride."""
        layouts.check("store", check, k, v, k_cache, v_cache, slot_mapping)
        N, bs, Hkv, D = k_cache.shape
        status = fn(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    slot_mapping.data_ptr(), k.shape[0], Hkv * D, N * bs)
        expect(status == 0, "slot_mapping", f"slots below the pool's {N * bs}", slot_mapping)

    return store_kv


def check_store_layout(k, v, k_cache, v_cache, slot_mapping, *, cache_dtype: torch.dtype) -> None:
    """What paged_store_kv relies on: each token's heads side by side in k and v, contiguous caches."""
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache, like=k_cache)
    check_build_cache(k_cache, v_cache, cache_dtype)
    T, (_, _, Hkv, D) = k.shape[0], k_cache.shape
    for name, t in (("k", k), ("v", v)):
        expect(t.dtype == cache_dtype and t.device.type == "cpu" and t.shape == (T, Hkv, D) and t.stride(2) == 1
               and t.stride(1) == D, name, f"[{T}, {Hkv}, {D}] {cache_dtype} rows, each token's heads side by "
               "side", t)
    check_int_vector("slot_mapping", slot_mapping, T, k.device)
    expect(slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous(), "slot_mapping",
           "a contiguous int64 vector", slot_mapping)


def check_build_cache(k_cache, v_cache, cache_dtype: torch.dtype) -> None:
    """Both functions index the pools as flat arrays of this build's dtype."""
    expect(k_cache.dtype == cache_dtype and k_cache.device.type == "cpu" and k_cache.is_contiguous()
           and v_cache.is_contiguous(), "k_cache", f"a contiguous {cache_dtype} CPU cache (this build's)", k_cache)
