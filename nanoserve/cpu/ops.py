"""A layer's elementwise steps on the CPU in C (ops.c): load them, check arguments, call them.

    ops = load()                         # None (one warning) if ops.c cannot be built here
    x = ops.add_rms_norm(h, a, w, eps)   # h += a in place (a=None: no add); returns w * h / rms(h)
    ops.rotary_(qk, cos, sin)            # RoPE in place on qk [T, heads, D] (rows may lie apart)
    m = ops.silu_mul(gate_up)            # silu(gate) * up from [T, 2I] -> [T, I]

Float32, or bfloat16 from a second build of the same file (`load(torch.bfloat16)`:
bf16 values, float32 arithmetic, rounded to bf16 where torch rounds). The C
code trusts its pointers and sizes, so every function
checks dtype, shape and layout first and raises ValueError naming the
argument (when the arguments' layout changes: the layers of a step repeat
it). cpu/llama.py is the one caller; it passes check=False after the
first layer of a forward, whose calls checked the layouts every later layer
repeats (building the key the checks compare costs ~5 us, 120 times a
step). It is compiled on first use and cached like the decode kernel
(cpu/build.py).
"""

from __future__ import annotations

import ctypes
from functools import cache, partial
from pathlib import Path

import torch

from nanoserve.cpu.build import FLAGS, load_library
from nanoserve.kernels.checks import CheckedLayouts, expect

SOURCE = Path(__file__).with_name("ops.c")
# The C code's a * b + c stay two roundings, as in torch (no fused multiply-add); no errno from
# sqrtf and no trap semantics, which lets the compiler vectorise the exp loop.
OPS_FLAGS = [*FLAGS, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]

ELEM_DTYPES = {torch.float32: [], torch.bfloat16: ["-DELEM_BF16"]}     # extra flags per tensor dtype

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _rows(name: str, t: torch.Tensor, width: int | None = None, dtype: torch.dtype = torch.float32) -> None:
    """A CPU matrix of `dtype` with contiguous rows (of `width` values, when given)."""
    expect(t.dtype == dtype and t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous(), name,
           f"a contiguous 2-d {str(dtype)[6:]} CPU tensor", t)
    if width is not None:
        expect(t.shape[1] == width, name, f"rows of {width} values", t)


class CpuOps:
    """Typed, checked Python faces of ops.c's three functions, for tensors of one dtype (the build's)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._add_rms_norm = lib.add_rms_norm
        self._add_rms_norm.argtypes = [P, P, P, P, I64, I64, F32]
        self._rotary = lib.rotary
        self._rotary.argtypes = [P, I64, P, P, I64, I64, I64]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [P, P, I64, I64]
        for fn in (self._add_rms_norm, self._rotary, self._silu_mul):
            fn.restype = None
        self._layouts = CheckedLayouts()      # each function's checks run when its arguments' layout changes
        self._checks = {name: partial(check, dtype=dtype) for name, check in
                        (("add_rms_norm", _check_norm), ("rotary_", _check_rotary), ("silu_mul", _check_silu_mul))}

    def add_rms_norm(self, h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, check: bool = True) -> torch.Tensor:
        """h [T, H] += a (in place; a=None: no add), then weight * h / sqrt(mean(h^2) + eps) -> new [T, H]."""
        if check:
            self._layouts.check("add_rms_norm", self._checks["add_rms_norm"], h, a, weight)
        out = torch.empty_like(h)
        self._add_rms_norm(h.data_ptr(), None if a is None else a.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), h.shape[0], h.shape[1], eps)
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check: bool = True) -> None:
        """RoPE in place on x [T, heads, D] (each row's heads contiguous; rows may be apart); cos, sin [T, D]."""
        if check:
            self._layouts.check("rotary_", self._checks["rotary_"], x, cos, sin)
        T, heads, D = x.shape
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), T, heads, D)

    def silu_mul(self, gate_up: torch.Tensor, check: bool = True) -> torch.Tensor:
        """gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
        if check:
            self._layouts.check("silu_mul", self._checks["silu_mul"], gate_up)
        T, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((T, inter), dtype=self.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), T, inter)
        return out


def _check_norm(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, *, dtype: torch.dtype) -> None:
    _rows("h", h, dtype=dtype)
    if a is not None:
        _rows("a", a, h.shape[1], dtype)
        expect(a.shape[0] == h.shape[0], "a", f"{h.shape[0]} rows like h", a)
    expect(weight.dtype == dtype and weight.device.type == "cpu" and weight.shape == (h.shape[1],)
           and weight.is_contiguous(), "weight", f"a contiguous {str(dtype)[6:]} CPU vector of {h.shape[1]}",
           weight)


def _check_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, dtype: torch.dtype) -> None:
    expect(x.dtype == dtype and x.device.type == "cpu" and x.dim() == 3, "x",
           f"a 3-d {str(dtype)[6:]} CPU tensor [tokens, heads, head_dim]", x)
    T, heads, D = x.shape
    expect(x.stride(2) == 1 and x.stride(1) == D and x.stride(0) >= heads * D and D % 2 == 0, "x",
           "each row's heads side by side, an even head_dim", x)
    _rows("cos", cos, D)
    _rows("sin", sin, D)
    expect(cos.shape[0] == T, "cos", f"{T} rows like x", cos)
    expect(sin.shape[0] == T, "sin", f"{T} rows like x", sin)


def _check_silu_mul(gate_up: torch.Tensor, *, dtype: torch.dtype) -> None:
    _rows("gate_up", gate_up, dtype=dtype)
    expect(gate_up.shape[1] % 2 == 0, "gate_up", "an even width [gate | up]", gate_up)


@cache
def load(dtype: torch.dtype = torch.float32) -> CpuOps | None:
    """The ops for tensors of `dtype`, built for this CPU, or None (with one warning) if they cannot be built."""
    if dtype not in ELEM_DTYPES:
        return None
    lib = load_library(SOURCE, OPS_FLAGS + ELEM_DTYPES[dtype], "the CPU layer ops",
                       "the layers take the torch path (same results, slower)")
    return None if lib is None else CpuOps(lib, dtype)
