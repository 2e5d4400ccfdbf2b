"""Decode attention on the CPU in a small C kernel (cpu_decode.c): build it, load it, call it.

The torch backend's decode path gathers every sequence's blocks into a copy
before torch's attention can read them (kernels/reference.py). On a CPU that
copy is most of the cost: the K/V bytes are written once more and read
twice. `cpu_decode.c` reads them once, in place, through the block table.

It is compiled on first use and cached (kernels/cpu_build.py). Without a
compiler, or if the build fails, `load()` warns once and returns None, and
the torch backend keeps its grouped torch path: the same numbers, a little
slower. `EngineConfig(cpu_kernel=False)` never builds it.

    decode = load(torch.float32)            # None if it cannot be built here
    out = decode(q, k_cache, v_cache, block_tables, seq_lens, scale)   # [B, Hq, D]

It links OpenMP (libgomp, the runtime torch's CPU build uses too), so it
runs on as many threads as `torch.set_num_threads` gives torch.
"""

from __future__ import annotations

import ctypes
import warnings
from functools import cache
from pathlib import Path

import torch

from nanoserve.kernels.checks import check_paged_args, expect
from nanoserve.kernels.cpu_build import FLAGS, build

SOURCE = Path(__file__).with_name("cpu_decode.c")
CACHE_DTYPES = {torch.float32: [], torch.bfloat16: ["-DCACHE_BF16"]}   # extra flags per cache dtype


@cache
def load(cache_dtype: torch.dtype):
    """The kernel for a cache of `cache_dtype` as a Python function, or None (with one warning) if unavailable."""
    if cache_dtype not in CACHE_DTYPES:
        return None
    try:
        lib = ctypes.CDLL(str(build(SOURCE, FLAGS + CACHE_DTYPES[cache_dtype])))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"nanoserve: the CPU decode kernel could not be built, so decode attention takes the "
                      f"torch path (same results, slower): {e}", stacklevel=2)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]

    def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
        """q [B, Hq, D], caches [N, bs, Hkv, D], block_tables [B, nb] int64, seq_lens [B] int64 -> [B, Hq, D]."""
        # The C code trusts these; a wrong shape, dtype or index would read the wrong memory, so check them
        # all (a ValueError naming the argument, as every kernel wrapper raises: kernels/checks.py).
        check_paged_args(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
        B, Hq, D = q.shape
        _, bs, Hkv, _ = k_cache.shape
        expect(k_cache.dtype == cache_dtype and k_cache.device.type == "cpu" and k_cache.is_contiguous()
               and v_cache.is_contiguous(), "k_cache", f"a contiguous {cache_dtype} CPU cache (this build's)",
               k_cache)
        expect(block_tables.dtype == seq_lens.dtype == torch.int64 and block_tables.shape[0] == B == len(seq_lens),
               "block_tables", f"int64 tables and lengths for the {B} queries", block_tables)
        expect(int(seq_lens.min()) >= 1 and int(seq_lens.max()) <= block_tables.shape[1] * bs, "seq_lens",
               f"lengths from 1 to {block_tables.shape[1] * bs} (what the tables hold)", seq_lens)
        expect(0 <= int(block_tables.min()) and int(block_tables.max()) < k_cache.shape[0], "block_tables",
               f"block ids below the pool's {k_cache.shape[0]}", block_tables)
        block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        status = fn(q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                    seq_lens.data_ptr(), out.data_ptr(), B, Hq, Hkv, D, bs, block_tables.shape[1], scale)
        if status != 0:
            raise MemoryError("the CPU decode kernel could not allocate its scratch buffers")
        return out.to(q.dtype)

    return decode_attention
