"""Faster matmuls on a CPU: oneDNN-packed weights, float32 math for bf16 models without bf16 units, our own panel kernel.

Two things make `nn.Linear` slow on a CPU, and both are fixed once, when the
runner starts, in a *view* of the model (`cpu_linear_view`): every `nn.Linear`
becomes a `CpuLinear`; all other parameters (embeddings, norms) are shared with
the original model, which is left untouched (engines may share one loaded model).

1. Packing. `F.linear` hands a row-major weight to the BLAS library on every
   call. oneDNN (the library behind torch's `mkldnn` ops, and vLLM's CPU
   linears) computes faster from a weight reordered once into its own blocked
   layout (`torch.ops.mkldnn._reorder_linear_weight`). Measured on one AMD EPYC
   core: 25 -> 31 GFLOP/s for a 32-row projection, 31 -> 37 at 512 rows, and
   19 -> 32 for SmolLM2's 49152-wide LM head at 32 rows. The packed copy costs
   the weights' memory a second time. On a CPU with bf16 units (AVX512-BF16,
   AMX) bf16 weights are packed too, and oneDNN multiplies them there: on
   one AMD Zen 4 core, 107 -> 151 GFLOP/s for SmolLM2's gate/up projection
   at 32 rows (`F.linear` in bf16 -> packed), twice float32's speed at 128
   rows and more (`can_pack_dtype`).

2. bf16 without bf16 units. A bf16 matmul multiplies bf16 numbers, adds the
   products in float32 and rounds the result to bf16. With AVX512-BF16 or AMX
   the CPU does that in hardware; without them (AVX2-only CPUs, e.g. AMD Zen
   1-3) torch's bf16 GEMM is a software loop: 3 GFLOP/s against 31 in float32.
   The same matmul runs on the float32 units with the same result up to the
   order of the additions: a float32 copy of a bf16 weight holds exactly the
   same values, the product of two bf16 numbers is exact in float32, and the
   sum is float32 either way. So `upcast=True` keeps a float32 copy of the
   weight, multiplies in float32 and rounds the output back to bf16.

3. Our own kernel. `PanelLinear` multiplies from a weight packed into panels
   of 16 or 32 output columns by cpu/matmul.c (float32) or cpu/matmul_bf16.c
   (bf16, on a CPU with AVX512-BF16): at a decode step's ~32 rows, with the
   weights streaming from memory, it keeps the multiply units busier than
   oneDNN does (it prefetches the next panel while multiplying this one) and
   costs a few microseconds a call instead of oneDNN's tens. The CPU Llama
   path (cpu/llama.py) uses it where the C code builds; CpuLinear
   stays the matmul of every other model and of `path="torch"`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.cpu.matmul import CpuMatmul, check_linear


def cpu_has_bf16_units() -> bool:
    """Does this CPU multiply bf16 in hardware (AVX512-BF16 or AMX)? torch's bf16 kernels need them to be fast."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def half_matmuls_need_fp32(dtype: torch.dtype) -> bool:
    """bf16 weights on a CPU whose bf16 matmuls would run in software (point 2 above): multiply in float32."""
    return dtype == torch.bfloat16 and not cpu_has_bf16_units()


def can_pack() -> bool:
    """oneDNN is in this torch build (x86 and ARM CPU wheels have it)."""
    return torch.backends.mkldnn.is_available()


def can_pack_dtype(dtype: torch.dtype) -> bool:
    """oneDNN multiplies packed weights of this dtype here: float32 always, bf16 on a CPU with bf16 units."""
    return can_pack() and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_bf16_units()))


class CpuLinear(nn.Module):
    """y = x @ W.T + b from an nn.Linear, optionally in float32 (`upcast`) and from a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear, upcast: bool, pack: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.upcast = upcast
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if upcast:    # exact copies: every bf16 value is a float32 value
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.packed = pack and can_pack_dtype(weight.dtype)
        if self.packed:   # oneDNN's blocked layout, tuned for ~32 rows (any row count works)
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
            # its matmul: the resolved overload (.default), not the overload packet, so no lookup per call
            self._linear_packed = torch.ops.mkldnn._linear_pointwise.default
        self.register_buffer("weight", weight, persistent=False)   # [out, in], or oneDNN's packed layout
        self.register_buffer("bias", bias, persistent=False)
        # The packed call's arguments after x, read as one plain attribute (a buffer's lookup goes through
        # nn.Module.__getattr__): the fast case below runs 121 times a decode step.
        self._packed_args = (weight, bias, "none", [], "") if self.packed else None
        self._dtype = weight.dtype            # what the packed call multiplies (x must match it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_args is not None and x.dim() == 2 and x.dtype == self._dtype:
            return self._linear_packed(x, *self._packed_args)        # cpu/llama.py's calls: [N, out]
        dtype = x.dtype
        if self.upcast:
            x = x.float()
        if self.packed:
            # The packed op wants 2-D rows.
            y = self._linear_packed(x if x.dim() == 2 else x.reshape(-1, self.in_features),
                                    *self._packed_args)                               # [N, out]
            if x.dim() != 2:
                y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if y.dtype == dtype else y.to(dtype)


class PanelLinear(nn.Module):
    """y = x @ W.T + b from an nn.Linear's weight, packed once in panels (cpu/matmul.c, float32; matmul_bf16.c,
    bf16: `mm.dtype`, which must be the weight's)."""

    def __init__(self, linear: nn.Linear, mm: CpuMatmul) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = mm.pack(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()   # float32 either way
        self.register_buffer("weight", packed, persistent=False)    # [panels, in, mm.panel]
        self.register_buffer("bias", bias, persistent=False)
        self._linear = mm.linear
        self._panel, self._dtype = mm.panel, mm.dtype
        self._args = (packed, self.out_features, bias)              # one plain attribute, read every call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] of the weight's dtype (rows of any stride) -> [T, out]."""
        # What the C code relies on, in the cheapest form (every projection call runs it); check_linear
        # raises the ValueError that names what is wrong.
        if not (x.dtype == self._dtype and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
                and x.shape[1] == self.in_features):
            check_linear(x, *self._args, self._panel, self._dtype)
        return self._linear(x, *self._args, check=False)


def cpu_linear_view(module: nn.Module, upcast: bool, pack: bool) -> nn.Module:
    """A copy of the module tree with every nn.Linear replaced by a CpuLinear; other parameters shared."""
    if isinstance(module, nn.Linear):
        return CpuLinear(module, upcast, pack)
    clone = copy.copy(module)
    # Its own dicts (parameters, buffers, hooks, children), holding the same tensors.
    clone.__dict__.update({k: copy.copy(v) for k, v in vars(module).items() if isinstance(v, dict)})
    for name, child in module._modules.items():
        clone._modules[name] = None if child is None else cpu_linear_view(child, upcast, pack)
    return clone
