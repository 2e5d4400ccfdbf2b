"""The CPU linear layers' matmul in C (matmul.c): pack a weight once, then multiply from it.

    mm = load()                                  # None (one warning) if matmul.c cannot be built here
    packed = mm.pack(linear.weight)              # [out, in] float32 -> panels of mm.panel columns (a new tensor)
    y = mm.linear(x, packed, out_features, bias) # x [T, in] -> [T, out] = x @ W.T + bias

Float32. The panel width is the build's: two of the CPU's widest vectors,
16 columns with 256-bit AVX2 (or NEON), 32 with AVX-512 (cpu_math.h's
VEC_LANES; the library says which, `panel_width()`). The packed tensor is
[panels, in, mm.panel]; `linear` checks that x, the
packed weight and the bias agree (shape, dtype, layout) before the C code
trusts them, and raises ValueError naming the argument. With check=False it
skips that: cpu/linear.py's PanelLinear, which every projection of the
CPU Llama path calls, tests x inline (a few attribute reads) and calls
check_linear only when that test fails, for the error that names the culprit.
Compiled on first use and cached like the other C kernels (cpu/build.py).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoserve.cpu.build import FLAGS, load_library
from nanoserve.kernels.checks import expect

SOURCE = Path(__file__).with_name("matmul.c")

P, I64 = ctypes.c_void_p, ctypes.c_int64


def _matrix(name: str, t: torch.Tensor, what: str) -> None:
    expect(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1, name,
           what, t)


class CpuMatmul:
    """Typed, checked Python faces of matmul.c's functions."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.panel_width.restype, lib.panel_width.argtypes = ctypes.c_int, []
        self.panel = lib.panel_width()      # output columns per panel (matmul.c's NR: 16 or 32)
        self._pack = lib.pack_weight
        self._pack.argtypes = [P, P, I64, I64]
        self._linear = lib.panel_linear
        self._linear.argtypes = [P, I64, P, P, P, I64, I64, I64, I64]
        self._pack.restype = self._linear.restype = None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> [ceil(out / P), in, P]: panels of P = self.panel output columns (zeros past `out`)."""
        _matrix("weight", weight, "a float32 CPU matrix [out, in]")
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        P = self.panel
        packed = torch.empty(((out_features + P - 1) // P, in_features, P), dtype=torch.float32)
        self._pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
        """x [T, in] (rows of any stride) @ W.T + bias -> a new [T, out_features], W packed by `pack`."""
        if check:
            check_linear(x, packed, out_features, bias, self.panel)
        rows, in_features = x.shape
        y = torch.empty((rows, out_features), dtype=torch.float32)
        self._linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                     y.data_ptr(), out_features, rows, out_features, in_features)
        return y


def check_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 panel: int) -> None:
    """ValueError naming the argument unless `linear` may hand these to the C code (panels of `panel` columns)."""
    _matrix("x", x, "a float32 CPU matrix [rows, in] with contiguous rows")
    panels = (out_features + panel - 1) // panel
    expect(packed.dtype == torch.float32 and packed.is_contiguous() and packed.device.type == "cpu"
           and tuple(packed.shape) == (panels, x.shape[1], panel), "packed",
           f"a packed weight [{panels}, {x.shape[1]}, {panel}] (CpuMatmul.pack of a [{out_features}, "
           f"{x.shape[1]}] weight)", packed)
    if bias is not None:
        expect(bias.dtype == torch.float32 and bias.is_contiguous() and tuple(bias.shape) == (out_features,),
               "bias", f"a contiguous float32 vector of {out_features}", bias)


@cache
def load() -> CpuMatmul | None:
    """The matmul, built for this CPU, or None (with one warning) if it cannot be built."""
    lib = load_library(SOURCE, FLAGS, "the CPU matmul",
                       "the linear layers use oneDNN (same results to float32 rounding, slower)")
    return None if lib is None else CpuMatmul(lib)
