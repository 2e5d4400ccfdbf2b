"""The CPU fast path: everything nanoserve does differently on a CPU to be fast, in one folder.

The code a student reads — models/llama.py, models/gpt2.py, kernels/reference.py
behind kernels/torch_backend.py — computes every step on any device. On a CPU
that is several times slower than it needs to be, so by default the runner
swaps parts of it for the ones here. Only the resolver of which
code runs imports this package (implementation.py; tests/test_import_graph.py
checks it), in one call, `fast_path()`, and the engine says what ran
(`LLMEngine.implementation`, the TUI header, `--stats`).
`EngineConfig(path="reading")` (`--reading-path` on the command line) runs
none of it: the reading path, the same tokens; `path="torch"` runs it without
the C files.

    build.py      compile a C file with the system's compiler on first use, cache the library
    cpu_math.h    what the C files share: vector types (8 floats, and the CPU's widest), a vectorisable exp
    attention.c   paged attention reading K/V in place through block tables; the K/V store
    attention.py  its Python face: argument checks, then the C call
    backend.py    the "cpu" attention backend: every row of a step through attention.c
    ops.c         a Llama layer's small steps: RMSNorm with the residual add, RoPE, silu(gate) * up
                  (built twice: float32, and bf16 values rounded where torch rounds)
    ops.py        their Python faces
    matmul.c      float32 matmuls from weights packed once in panels of two vectors (16 or 32 columns)
    matmul_bf16.c the same panels for bf16, two k at a time on the CPU's bf16 instruction (AVX512-BF16)
    matmul.py     their Python face: pack a weight, multiply from it
    linear.py     linear layers: panels, oneDNN-packed weights (float32; bf16 on CPUs with bf16 units),
                  float32 math for bf16 weights on CPUs without them
    llama.py      CpuLlama: a float32 or bf16 Llama's forward in fewer, larger steps
    forward.c     CpuLlama's layers in one C call: the same C functions, called from C, in the same order
    forward.py    its Python face: the layers' pointers prepared once, the step's filled in, one call
    memory.py     keep freed memory for the next step; 2 MB pages for the KV cache

What `fast_path()` picks (each part falls back alone, and says why):

    model      CpuLlama (a float32 Llama, or a bf16 one on a CPU with bf16 units; the C files allowed,
               ops.c built), else the loaded model with its linear layers swapped (linear.py),
               else the loaded model itself
    matmul     float32: matmul.c's panels (oneDNN-packed where matmul.c is not built); bf16 on a CPU
               with bf16 units: matmul_bf16.c's panels (AVX512-BF16), else oneDNN-packed bf16 weights on
               those units (AMX without AVX512-BF16, or matmul_bf16.c not built); bf16 without them:
               float32 copies of the weights, oneDNN-packed
    attention  the "cpu" backend (when chosen: attention.c built, a float32 or bf16 cache), else
               None: the torch backend (float32 math on a bf16 cache when `upcast`)
    KV cache   allocated with 2 MB pages (memory.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.attention import AttentionBackend
from nanoserve.cpu import attention as cpu_attention
from nanoserve.cpu import build
from nanoserve.cpu import matmul as cpu_matmul
from nanoserve.cpu.backend import CpuBackend
from nanoserve.cpu.forward import OneCall
from nanoserve.cpu.linear import can_pack, can_pack_dtype, cpu_linear_view, half_matmuls_need_fp32
from nanoserve.cpu.llama import CpuLlama, cpu_llama_view
from nanoserve.cpu.memory import huge_page_zeros, keep_freed_memory


@dataclass(slots=True)
class FastPath:
    """What the runner uses on a CPU, and how to say so."""

    model: nn.Module                 # a view of the loaded model (which is never changed), or the model itself
    attention: AttentionBackend | None   # the "cpu" backend when asked for and built; None: torch's
    upcast: bool                     # a bf16 cache on a CPU without bf16 units: torch attention in float32 is faster
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]   # allocates the KV cache
    matmul: str                      # what multiplies the linear layers
    note: str = ""                   # why a part fell back ("" when everything here runs)
    label: str = ""                  # what the model view is, when more than its class says ("": the class)


def fast_path(model: nn.Module, dtype: torch.dtype, c_files: bool, c_attention: bool) -> FastPath:
    """The CPU versions of the model, its attention and its KV cache (see the module docstring).

    `c_files`: the C files may be used (the "fast" path; "torch" leaves them out); `c_attention`: the
    "cpu" attention backend was chosen (implementation.choose)."""
    keep_freed_memory()
    notes, failed = [], []      # why parts fell back; the C files this tried to build
    upcast = half_matmuls_need_fp32(dtype)          # bf16 weights on a CPU without bf16 units: float32 math
    pack = can_pack() and (upcast or can_pack_dtype(dtype))   # bf16 packs where the CPU has bf16 units
    view, matmul = model, "torch (nn.Linear)"
    if c_files and pack and not upcast:
        fused = cpu_llama_view(model, dtype)        # None: not a plain float32/bf16 Llama, or ops.c did not build
        if fused is not None:
            view = fused
            matmul = (f"panels{_bf16(dtype)} (cpu/{fused.panels})" if fused.panels
                      else f"oneDNN packed{_bf16(dtype)} (cpu/linear.py)")
        failed += ["ops.c", cpu_matmul.SOURCES[dtype].name]
    if view is model and (upcast or pack):
        view = cpu_linear_view(model, upcast, pack)
        matmul = ("oneDNN packed" + ("" if upcast else _bf16(dtype)) if pack else "torch") \
            + (", float32 math on bf16 weights" if upcast else "") + " (cpu/linear.py)"
    attention = None
    if c_files and c_attention and dtype in cpu_attention.CACHE_DTYPES:
        attend, store = cpu_attention.load(dtype), cpu_attention.load_store(dtype)
        if attend is not None and store is not None:
            attention = CpuBackend(attend, store)
        failed.append("attention.c")
    elif c_files and c_attention:
        notes.append(f"the C attention kernel reads float32 and bfloat16 caches, not {str(dtype)[6:]}")
    label = ""
    if isinstance(view, CpuLlama) and attention is not None:   # every call of a layer may be C: one call for all
        view.one_call = OneCall.build(view)
        if view.one_call is not None:
            label = "CpuLlama (cpu/llama.py), its layers in one C call (cpu/forward.c)"
        failed.append("forward.c")
    return FastPath(view, attention, upcast, huge_page_zeros, matmul, "; ".join(notes + _failures(failed)), label)


def _bf16(dtype: torch.dtype) -> str:
    """" bf16" for bf16 matmuls (on the CPU's bf16 units), "" for float32."""
    return " bf16" if dtype == torch.bfloat16 else ""


def _failures(files: list[str]) -> list[str]:
    """Why these C files could not be built here (build.failures), one note per reason."""
    by_reason: dict[str, list[str]] = {}
    for f in dict.fromkeys(files):
        if f in build.failures:
            by_reason.setdefault(build.failures[f], []).append(f)
    return [f"{', '.join(fs)} not built: {reason}" for reason, fs in by_reason.items()]

