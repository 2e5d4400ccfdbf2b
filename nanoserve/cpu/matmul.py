"""The CPU linear layers' matmul in C (matmul.c): pack a weight once, then multiply from it.

    mm = load()                                  # None (one warning) if matmul.c cannot be built here
    packed = mm.pack(linear.weight)              # [out, in] float32 -> panels of mm.panel columns (a new tensor)
    y = mm.linear(x, packed, out_features, bias) # x [T, in] -> [T, out] = x @ W.T + bias

    mm16 = load(torch.bfloat16)                  # matmul_bf16.c: bf16 x and W (None without AVX512-BF16)

Float32 from matmul.c; bf16 from matmul_bf16.c, the same panels multiplied
two k at a time by the CPU's bf16 instruction (built only on a CPU that has
it; its bias is float32, its result bf16). The panel width is the build's:
two of the CPU's widest vectors, 16 columns with 256-bit AVX2 (or NEON), 32
with AVX-512 (cpu_math.h's VEC_LANES; the library says which,
`panel_width()`). The packed tensor is [panels, in, mm.panel] (bf16:
[panels, ceil(in / 2), mm.panel, 2], pairs along in); `linear` checks that x, the
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
SOURCES = {torch.float32: SOURCE, torch.bfloat16: Path(__file__).with_name("matmul_bf16.c")}

P, I64 = ctypes.c_void_p, ctypes.c_int64


def _matrix(name: str, t: torch.Tensor, what: str, dtype: torch.dtype = torch.float32) -> None:
    expect(t.dtype == dtype and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1, name, what, t)


class CpuMatmul:
    """Typed, checked Python faces of matmul.c's functions (or matmul_bf16.c's: the same names)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype                  # of x, W and y (the bias is float32 either way)
        lib.panel_width.restype, lib.panel_width.argtypes = ctypes.c_int, []
        self.panel = lib.panel_width()      # output columns per panel (matmul.c's NR: 16 or 32)
        self._pack = lib.pack_weight
        self._pack.argtypes = [P, P, I64, I64]
        self._linear = lib.panel_linear
        self._linear.argtypes = [P, I64, P, P, P, I64, I64, I64, I64]
        self._pack.restype = self._linear.restype = None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> [ceil(out / P), in, P]: panels of P = self.panel output columns (zeros past `out`).
        bf16: [ceil(out / P), ceil(in / 2), P, 2], the values of in taken in pairs."""
        _matrix("weight", weight, f"a {str(self.dtype)[6:]} CPU matrix [out, in]", self.dtype)
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        packed = torch.empty(packed_shape(out_features, in_features, self.panel, self.dtype), dtype=self.dtype)
        self._pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
        """x [T, in] (rows of any stride) @ W.T + bias -> a new [T, out_features], W packed by `pack`."""
        if check:
            check_linear(x, packed, out_features, bias, self.panel, self.dtype)
        rows, in_features = x.shape
        y = torch.empty((rows, out_features), dtype=self.dtype)
        self._linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                     y.data_ptr(), out_features, rows, out_features, in_features)
        return y


def packed_shape(out_features: int, in_features: int, panel: int, dtype: torch.dtype) -> tuple[int, ...]:
    panels = (out_features + panel - 1) // panel
    return (panels, in_features, panel) if dtype == torch.float32 else (panels, (in_features + 1) // 2, panel, 2)


def check_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 panel: int, dtype: torch.dtype = torch.float32) -> None:
    """ValueError naming the argument unless `linear` may hand these to the C code (panels of `panel` columns)."""
    _matrix("x", x, f"a {str(dtype)[6:]} CPU matrix [rows, in] with contiguous rows", dtype)
    shape = packed_shape(out_features, x.shape[1], panel, dtype)
    expect(packed.dtype == dtype and packed.is_contiguous() and packed.device.type == "cpu"
           and tuple(packed.shape) == shape, "packed",
           f"a packed weight {list(shape)} (CpuMatmul.pack of a [{out_features}, {x.shape[1]}] weight)", packed)
    if bias is not None:
        expect(bias.dtype == torch.float32 and bias.is_contiguous() and tuple(bias.shape) == (out_features,),
               "bias", f"a contiguous float32 vector of {out_features}", bias)


@cache
def load(dtype: torch.dtype = torch.float32) -> CpuMatmul | None:
    """The matmul for `dtype`, built for this CPU, or None (with one warning) if it cannot be built.

    bf16 only where the CPU has AVX512-BF16 (None, without a warning, elsewhere: there bf16 matmuls run
    in float32 or through oneDNN, cpu/linear.py)."""
    if dtype not in SOURCES or (dtype == torch.bfloat16 and not torch.cpu._is_avx512_bf16_supported()):
        return None
    lib = load_library(SOURCES[dtype], FLAGS, f"the CPU matmul ({str(dtype)[6:]})",
                       f"the linear layers use oneDNN (same results to {str(dtype)[6:]} rounding, slower)")
    return None if lib is None else CpuMatmul(lib, dtype)
