"""bf16 models on CPUs without bf16 units: every matmul in float32, on the bf16 weights' exact values.

A bf16 matmul multiplies bf16 numbers, adds the products in float32 and rounds
the result to bf16. On an x86 CPU with AVX512-BF16 or AMX, torch does that in
hardware. Without them (any AVX2-only CPU, e.g. AMD Zen 1-3) torch's bf16
GEMM is a slow software loop: one AMD EPYC core measured 3 GFLOP/s in bf16
against 31 in float32.

The same matmul runs on the float32 units, with the same result up to the
order of the additions (which already differs between any two GEMM libraries):

* a bf16 number is a float32 with the low 16 mantissa bits zero, so a float32
  copy of a bf16 weight holds exactly the same values;
* the product of two bf16 numbers (8-bit mantissas) is exact in float32;
* the sum is accumulated in float32 either way, then rounded to bf16.

`with_fp32_matmuls(model)` returns a view of the model in which every
`nn.Linear` is an `Fp32Linear` holding such a float32 copy (made once); all
other parameters (embeddings, norms) are shared with the original, which is
left untouched (engines may share one loaded model). The price: the matmul
weights take float32 memory, twice bf16's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Fp32Linear(nn.Module):
    """y = x @ W.T + b computed in float32 from a half-precision Linear, rounded back to x's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Exact copies: every bf16 value is a float32 value.
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)   # [out, in]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def with_fp32_matmuls(module: nn.Module) -> nn.Module:
    """A copy of the module tree with every nn.Linear replaced by an Fp32Linear; other parameters shared."""
    if isinstance(module, nn.Linear):
        return Fp32Linear(module)
    clone = copy.copy(module)
    # Its own dicts (parameters, buffers, hooks, children), holding the same tensors.
    clone.__dict__.update({k: copy.copy(v) for k, v in vars(module).items() if isinstance(v, dict)})
    for name, child in module._modules.items():
        clone._modules[name] = None if child is None else with_fp32_matmuls(child)
    return clone
