"""Decode attention on the CPU in a small C kernel (cpu_decode.c): build it, load it, call it.

The torch backend's decode path gathers every sequence's blocks into a copy
before torch's attention can read them (kernels/reference.py). On a CPU that
copy is most of the cost: the K/V bytes are written once more and read
twice. `cpu_decode.c` reads them once, in place, through the block table.

There is no build step at install time. The first engine that wants the
kernel compiles it with the system's C compiler (`$CC`, else `cc`; about a
second) into `~/.cache/nanoserve/kernels/`, named by a hash of the source,
the flags and this CPU's features, and loads it with ctypes; later engines
load the file. Without a compiler, or if the build fails, `load()` warns
once and returns None, and the torch backend keeps its grouped torch path:
the same numbers, a little slower. `EngineConfig(cpu_kernel=False)` never
builds it.

    decode = load(torch.float32)            # None if it cannot be built here
    out = decode(q, k_cache, v_cache, block_tables, seq_lens, scale)   # [B, Hq, D]

It links OpenMP (libgomp, the runtime torch's CPU build uses too), so it
runs on as many threads as `torch.set_num_threads` gives torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
CACHE_DTYPES = {torch.float32: [], torch.bfloat16: ["-DCACHE_BF16"]}   # extra flags per cache dtype


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanoserve" / "kernels"


def _cpu_features() -> str:
    """This CPU's feature flags (-march=native builds for them; another CPU needs its own build)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(flags: list[str]) -> Path:
    """Compile cpu_decode.c with `flags` (or find it built); raises RuntimeError if that fails."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *flags, _cpu_features()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"cpu_decode-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: two processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    proc = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cc} failed:\n{proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


@cache
def load(cache_dtype: torch.dtype):
    """The kernel for a cache of `cache_dtype` as a Python function, or None (with one warning) if unavailable."""
    if cache_dtype not in CACHE_DTYPES:
        return None
    try:
        lib = ctypes.CDLL(str(_build(FLAGS + CACHE_DTYPES[cache_dtype])))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"nanoserve: the CPU decode kernel could not be built, so decode attention takes the "
                      f"torch path (same results, slower): {e}", stacklevel=2)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]

    def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
        """q [B, Hq, D], caches [N, bs, Hkv, D], block_tables [B, nb] int64, seq_lens [B] int64 -> [B, Hq, D]."""
        B, Hq, D = q.shape
        _, bs, Hkv, _ = k_cache.shape
        # The C code trusts these; a wrong shape or dtype would read the wrong memory, so check them all.
        assert k_cache.dtype == v_cache.dtype == cache_dtype and k_cache.shape == v_cache.shape
        assert k_cache.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert k_cache.shape[3] == D and Hq % Hkv == 0
        assert block_tables.dtype == seq_lens.dtype == torch.int64 and block_tables.shape[0] == B == len(seq_lens)
        assert int(seq_lens.min()) >= 1 and int(seq_lens.max()) <= block_tables.shape[1] * bs
        assert 0 <= int(block_tables.min()) and int(block_tables.max()) < k_cache.shape[0]
        block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        status = fn(q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                    seq_lens.data_ptr(), out.data_ptr(), B, Hq, Hkv, D, bs, block_tables.shape[1], scale)
        if status != 0:
            raise MemoryError("the CPU decode kernel could not allocate its scratch buffers")
        return out.to(q.dtype)

    return decode_attention
