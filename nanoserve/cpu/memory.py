"""Memory settings for a CPU engine: keep freed memory for the next step, and 2 MB pages for the KV cache.

Two costs that have nothing to do with the model show up in a CPU step's profile:

1. Page faults. glibc's malloc hands out blocks larger than 128 KB with a
   fresh mmap, and returns them to the kernel on free. A step's larger
   tensors (a 512-token chunk's [512, 3072] MLP activations, 6 MB) are freed
   at the end of the step, and the next step gets fresh pages, which the
   kernel zeroes, 4 KB at a time, on first touch. (glibc raises that
   threshold by itself after such frees, but only as far as the sizes it
   has seen, and it still trims the heap's top after each step.)
   `keep_freed_memory()` raises glibc's thresholds (mallopt), so those
   blocks come from, and go back to, the process's own heap. vLLM's CPU backend gets the same by preloading
   tcmalloc (its docs ask for it).
2. TLB misses. Decode attention reads K/V blocks scattered over the whole
   pool, each on a different 4 KB page. `huge_page_zeros` asks Linux for
   2 MB pages (madvise MADV_HUGEPAGE, before the memory is first touched), so
   one TLB entry covers 170 of SmolLM2's 12 KB blocks instead of a third of one.

Both are hints: where they do not apply (not glibc, not Linux, transparent
huge pages off) nothing changes but the speed. The runner uses them on a CPU
with fast paths on; measured with benchmarks/bench_throughput.py.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

import torch

HUGE_PAGE = 2 << 20              # x86-64's transparent huge page
MADV_HUGEPAGE = 14               # <sys/mman.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3   # <malloc.h>


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc if hasattr(libc, "mallopt") else None      # mallopt: glibc (musl has none)
    except OSError:
        return None


@cache
def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MB from the heap and keep up to 256 MB of freed heap (glibc). True if set."""
    libc = _libc()
    if libc is None:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, 32 << 20),        # blocks below this come from the heap, not a fresh mmap
        (M_TRIM_THRESHOLD, 256 << 20),       # give memory back only when this much is free at the top
        (M_TOP_PAD, 64 << 20)))              # grow the heap in steps of this much


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, asking for 2 MB pages first (a hint; big tensors only)."""
    # At 32 MB or more (keep_freed_memory's threshold) glibc maps fresh, untouched pages, which the hint
    # turns into 2 MB pages at the first touch; a smaller tensor may reuse heap pages, where it helps less.
    t = torch.empty(shape, dtype=dtype)
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE   # whole huge pages inside
    libc = _libc()
    if libc is not None and hi > lo:
        libc.madvise(lo, hi - lo, MADV_HUGEPAGE)         # fails harmlessly where THP is off
    return t.zero_()                                     # the first touch: the kernel maps the pages now
