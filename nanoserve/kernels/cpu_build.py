"""Compile a kernel's C file with the system's C compiler on first use, and cache the library.

The CPU fast paths have three small C files (cpu_decode.c: attention over the
paged cache; cpu_ops.c: a layer's elementwise steps; cpu_matmul.c: the linear
layers' matmul) and a header they share (cpu_math.h: a vectorisable exp). There is no build step at install
time: the first engine that wants one compiles it (`$CC`, else `cc`; about a
second) into `~/.cache/nanoserve/kernels/`, named by a hash of the source and
headers, the compiler, the flags and this CPU's features (the files are built
with `-march=native`, so another CPU needs its own build), and later engines
load the file. A failed build raises RuntimeError; `load_library` turns that
into one warning and None, and each loader then keeps its fallback path.
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
from pathlib import Path

# Both files: optimised for this CPU, OpenMP (libgomp, the runtime torch's CPU build uses, so one
# thread pool and torch's thread count), a shared library ctypes can load.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


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


def build(source: Path, flags: list[str]) -> Path:
    """Compile `source` with `flags` (or find it built); raises RuntimeError if that fails."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    # The headers beside the source (cpu_math.h) are part of what gets compiled, so part of the name.
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, cc, *flags, _cpu_features()]).encode())
    key = key.hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: two processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{cc} took longer than {e.timeout} s") from e
    except OSError as e:
        raise RuntimeError(f"{cc} could not be run: {e}") from e
    finally:
        if os.path.exists(tmp):          # anything but a finished build: no half-written file left behind
            os.unlink(tmp)
    return out


def load_library(source: Path, flags: list[str], what: str, fallback: str, stacklevel: int = 3) -> ctypes.CDLL | None:
    """`source` built with `flags` and loaded, or None with one warning: "<what> could not be built, so <fallback>".

    stacklevel: where the warning points, counted from here (3: the caller of the function that called this)."""
    try:
        return ctypes.CDLL(str(build(source, flags)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"nanoserve: {what} could not be built, so {fallback}: {e}", stacklevel=stacklevel)
        return None
