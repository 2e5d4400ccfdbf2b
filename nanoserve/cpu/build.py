"""Compile a kernel's C file with the system's C compiler on first use, and cache the library.

The CPU fast path has three small C files (attention.c: attention over the
paged cache; ops.c: a layer's elementwise steps; matmul.c: the linear
layers' matmul) and a header they share (cpu_math.h: vector types, one of
them as wide as this CPU's widest registers, and a vectorisable exp). The
files are built with `-march=native`, so the compiler targets this CPU's
vector units (AVX2, AVX-512, NEON) and the code sizes its vectors by what
the compiler says the target has (__AVX512F__: 16 floats, else 8). There
is no build step at install time: the first engine that wants one compiles it (`$CC`, which may carry arguments such as
"ccache gcc", else `cc`; about a second) into `~/.cache/nanoserve/kernels/`,
named by a hash of the source and headers, the compiler, the flags and this
CPU's features (the files are built with `-march=native`, so another CPU
needs its own build), and later engines load the file. A failed build raises
RuntimeError; `load_library` turns that into one warning (pointing at the
user's line that built the engine) and None, remembers why in `failures`,
and the engine reports it (`ModelRunner.implementation`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# Both files: optimised for this CPU, OpenMP (libgomp, the runtime torch's CPU build uses, so one
# thread pool and torch's thread count), a shared library ctypes can load.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

# Why a C file could not be built here, by file name ("attention.c": "no C compiler found ..."): what the
# engine reports as the path that ran instead. (Filled by load_library; a build is tried once a process.)
failures: dict[str, str] = {}


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
    cc_words = shlex.split(os.environ.get("CC") or "cc")     # $CC may be "ccache gcc" or "gcc -m64"
    cc = shutil.which(cc_words[0]) if cc_words else None
    if cc is None:
        raise RuntimeError(f"no C compiler found ({cc_words[0] if cc_words else '$CC'} is not installed: "
                           "set $CC, or install gcc)")
    cc_words[0] = cc
    # The headers beside the source (cpu_math.h) are part of what gets compiled, so part of the name.
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *cc_words, *flags, _cpu_features()]).encode())
    key = key.hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: two processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cc_words, *flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=120)
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


def load_library(source: Path, flags: list[str], what: str, fallback: str) -> ctypes.CDLL | None:
    """`source` built with `flags` and loaded, or None with one warning: "<what> could not be built, so <fallback>".

    The warning points at the first line outside nanoserve (the user's `LLMEngine(...)`), and the reason
    is kept in `failures` under the file's name."""
    try:
        lib = ctypes.CDLL(str(build(source, flags)))
        failures.pop(source.name, None)
        return lib
    except (RuntimeError, OSError) as e:
        failures[source.name] = str(e).splitlines()[0]
        warnings.warn(f"nanoserve: {what} could not be built, so {fallback}: {e}", stacklevel=_user_stacklevel())
        return None


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, for a warn in our caller, that names the first frame outside nanoserve."""
    package = str(Path(__file__).resolve().parents[1])      # .../nanoserve
    frame, level = sys._getframe(1), 1                      # level 1: the function that calls warnings.warn
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
