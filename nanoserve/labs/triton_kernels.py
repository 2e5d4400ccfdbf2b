"""The triton-decode lab's kernels, built around a student's `online_softmax_step`: worker side only.

Triton inlines a @triton.jit helper into the kernel that calls it, and its
interpreter runs that Python on the CPU, so a kernel around the student's
step *is* the student's code: it is built and run in the lab's worker, never
in the checker. The checker calls these functions as helpers
(`ctx.helper("nanoserve.labs.triton_kernels:decode", ctx.module, ...)`) and
gets tensors back, which it compares with its own torch reference.

    kernels_with(student)   (decode module, prefill module): the engine's kernel sources, loaded as fresh
                            modules whose `online_softmax_step` and `load_kv_tile` are the student's
    step_once(...)          one call of the student's step inside a one-program kernel
    fold(student, s, v)     the student's step over several tiles, acc / l at the end
    decode(student, ...)    the engine's decode kernel with the student's step

Triton runs under its interpreter (TRITON_INTERPRET=1, which the worker sets before triton is imported).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from types import ModuleType

import torch

_count = itertools.count()
IMPORT = "from nanoserve.kernels.triton_common import load_kv_tile, online_softmax_step"
_built: dict[int, tuple[ModuleType, ModuleType]] = {}


def require_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("this lab runs Triton under its interpreter: start with TRITON_INTERPRET=1")


def _load_with(name: str, student: ModuleType) -> ModuleType:
    """A fresh copy of the engine's module `name` whose shared Triton helpers are the student's."""
    spec = importlib.util.find_spec(name)
    with open(spec.origin) as f:
        source = f.read()
    assert IMPORT in source, f"{name} no longer imports its helpers as the lab expects"
    module = ModuleType(f"{name}_lab{next(_count)}")
    module.__file__ = spec.origin
    sys.modules[module.__name__] = module            # triton's interpreter reads a function's module
    module.__dict__.update(load_kv_tile=student.load_kv_tile, online_softmax_step=student.online_softmax_step)
    exec(compile(source.replace(IMPORT, ""), spec.origin, "exec"), module.__dict__)
    return module


def kernels_with(student: ModuleType) -> tuple[ModuleType, ModuleType]:
    """(decode module, prefill module) built around the student's helpers (once per student module)."""
    require_interpreter()
    return build(student)


def build(student: ModuleType) -> tuple[ModuleType, ModuleType]:
    """kernels_with without the interpreter check: tests/test_triton_compile.py builds them for a GPU target."""
    if id(student) not in _built:
        _built[id(student)] = (_load_with("nanoserve.kernels.triton_decode", student),
                               _load_with("nanoserve.kernels.triton_prefill", student))
    return _built[id(student)]


def decode(student: ModuleType, *args, **kwargs) -> torch.Tensor:
    """The engine's decode kernel with the student's step: `decode_attention(*args, **kwargs)`."""
    return kernels_with(student)[0].decode_attention(*args, **kwargs)


def _kernels(student: ModuleType) -> ModuleType:
    """triton_fold.py's probe kernels around the student's step."""
    return _load_with("nanoserve.labs.triton_fold", student)


def fold(student: ModuleType, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The student's step over tiles s [T, R, N], v [T, N, D] inside a one-program kernel: acc / l, [R, D]."""
    require_interpreter()
    out = torch.empty(s.shape[1], v.shape[2])
    _kernels(student).fold_kernel[(1,)](s.contiguous(), v.contiguous(), out, TILES=s.shape[0], R=s.shape[1],
                                        N=s.shape[2], D=v.shape[2])
    return out


def step_once(student: ModuleType, m, l, acc, s, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the student's step returns for (m [R], l [R], acc [R, D], s [R, N], v [N, D])."""
    require_interpreter()
    m2, l2, acc2 = torch.empty_like(m), torch.empty_like(l), torch.empty_like(acc)
    _kernels(student).step_kernel[(1,)](m.contiguous(), l.contiguous(), acc.contiguous(), s.contiguous(),
                                        v.contiguous(), m2, l2, acc2, R=s.shape[0], N=s.shape[1], D=v.shape[1])
    return m2, l2, acc2
