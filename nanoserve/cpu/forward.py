"""CpuLlama's layers in one C call (forward.c): prepare the pointers once, fill the step's, call.

    one = OneCall.build(cpu_llama, dtype)    # None where it does not apply (see `build`) or cannot be built
    a = one.run(h, cos, sin, kv_caches, meta)   # every layer; returns the last MLP output (not yet added to h)

cpu/llama.py's CpuLlamaLayer.forward is the loop to read: eleven C calls per
layer, each made from Python. forward.c makes the same calls, from C, with
the same arguments: the same numbers, without ~10 us of Python per call (330
calls a step for SmolLM2's 30 layers). The pieces:

    struct kernels   the addresses of the C functions (ops.c, matmul*.c, attention.c), from their libraries
    struct dims      the model's sizes
    struct layer     each layer's packed weights, norms, caches, scale and window: filled once, and again
                     only when the runner hands other caches
    struct step      this forward's tensors: the residual stream h, one scratch buffer carved into the
                     activations, RoPE's cos and sin, and the attention backend's slots, tables and lengths

It applies where CpuLlamaLayer's calls are all C calls: panels (matmul.c or
matmul_bf16.c, not oneDNN), the "cpu" attention backend (cpu/backend.py),
and no Qwen3 QK-norm (two torch calls between the matmul and RoPE).
The layouts the C functions trust are checked here, cheaply, every call (the
tensors are built by the runner and the backend, so they pass); the values
(slots, block ids, lengths) are checked in C by store and attend, as always.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoserve.cpu import attention as cpu_attention
from nanoserve.cpu import matmul as cpu_matmul
from nanoserve.cpu.build import FLAGS, load_library
from nanoserve.kernels.checks import expect

SOURCE = Path(__file__).with_name("forward.c")
P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Kernels(ctypes.Structure):
    _fields_ = [(name, P) for name in ("add_rms_norm", "rotary", "silu_mul", "linear", "store", "attend")]


class Dims(ctypes.Structure):
    _fields_ = [(name, I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "elem",
                                         "block_size", "num_blocks")]


class Layer(ctypes.Structure):
    _fields_ = [("norm1", P), ("norm2", P), ("eps1", F32), ("eps2", F32),
                *[(name, P) for name in ("qkv", "o", "gate_up", "down",
                                         "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "k_cache", "v_cache")],
                ("scale", F32), ("window", I64)]


class Step(ctypes.Structure):
    _fields_ = [("rows", I64),
                *[(name, P) for name in ("h", "x", "qkv", "o", "attn", "gate_up", "act", "a", "cos", "sin",
                                         "slots", "tables", "lens")],
                ("max_blocks", I64)]


@cache
def library() -> ctypes.CDLL | None:
    """forward.c built (a few lines, no vector code: any C compiler), or None with one warning."""
    lib = load_library(SOURCE, FLAGS, "the CPU forward in one call",
                       "CpuLlama calls its C functions from Python, layer by layer (same results, slower)")
    if lib is not None:
        lib.forward_layers.restype = ctypes.c_int
        lib.forward_layers.argtypes = [ctypes.POINTER(Kernels), ctypes.POINTER(Dims), ctypes.POINTER(Layer), I64,
                                       ctypes.POINTER(Step)]
    return lib


def _address(fn) -> int:
    """The C address of a library function (a ctypes function object holds it as its one pointer)."""
    return P.from_buffer(fn).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class OneCall:
    """A CpuLlama's layers as one call of forward.c's forward_layers (module docstring)."""

    def __init__(self, lib: ctypes.CDLL, model, linear, attend, store) -> None:
        """`model`: a CpuLlama whose projections are all PanelLinear and which has no QK-norm (`build` checks);
        `linear`: matmul*.c's panel_linear, `attend`, `store`: attention.c's two functions, for the model's dtype
        (ctypes functions)."""
        layer0 = model.layers[0]
        self._fn = lib.forward_layers
        self.dtype = model.ops.dtype
        self.kernels = Kernels(*(_address(f) for f in (model.ops._add_rms_norm, model.ops._rotary,
                                                        model.ops._silu_mul, linear, store, attend)))
        self.hidden = model.embed_tokens.weight.shape[1]
        self.inter = layer0.down.in_features
        self.heads, self.kv_heads, self.head_dim = layer0.num_heads, layer0.num_kv_heads, layer0.head_dim
        # activations per row, in the order Step carves them from one scratch buffer (each region 64-byte aligned)
        widths = [self.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, self.heads * self.head_dim,
                  self.hidden, 2 * self.inter, self.inter, self.hidden]
        self._widths = [-(-w // 32) * 32 for w in widths]
        self._elem = torch.empty((), dtype=self.dtype).element_size()
        self._model = model
        self._layers = None               # the Layer array, for the caches it was filled with
        self._caches = None
        self.step = Step()

    @classmethod
    def build(cls, model) -> OneCall | None:
        """For a CpuLlama whose layers call only C (panels, no QK-norm), with forward.c and attention.c built."""
        from nanoserve.cpu.linear import PanelLinear
        if any(layer.qk_norms is not None or not all(type(p) is PanelLinear for p in
               (layer.qkv, layer.o, layer.gate_up, layer.down)) for layer in model.layers):
            return None
        lib, mm = library(), cpu_matmul.load(model.ops.dtype)    # (the panels' library: built already)
        attention = cpu_attention.library(model.ops.dtype)
        if lib is None or mm is None or attention is None:
            return None
        return cls(lib, model, mm._linear, attention.paged_decode_attention, attention.paged_store_kv)

    def _bind(self, kv_caches) -> None:
        """Fill every layer's struct (weights, norms, caches): once, and again for other caches."""
        k0 = kv_caches[0][0]
        for k_cache, v_cache in kv_caches:
            expect(k_cache.dtype == v_cache.dtype == self.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
                   and k_cache.device.type == "cpu" and k_cache.shape == v_cache.shape == k0.shape
                   and tuple(k0.shape[2:]) == (self.kv_heads, self.head_dim), "kv_caches",
                   f"contiguous {self.dtype} CPU caches [N, bs, {self.kv_heads}, {self.head_dim}]", k_cache)
        layers = (Layer * len(self._model.layers))()
        for spec, layer, (k_cache, v_cache) in zip(layers, self._model.layers, kv_caches):
            (w1, eps1), (w2, eps2) = layer.norm1_args, layer.norm2_args
            spec.norm1, spec.norm2, spec.eps1, spec.eps2 = w1.data_ptr(), w2.data_ptr(), eps1, eps2
            for name in ("qkv", "o", "gate_up", "down"):
                lin = getattr(layer, name)
                setattr(spec, name, lin.weight.data_ptr())
                setattr(spec, name + "_bias", _ptr(lin.bias))
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            spec.scale, spec.window = layer.scale, layer.window or 0
        self.dims = Dims(self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self._elem,
                         k0.shape[1], k0.shape[0])
        self._layers, self._caches = layers, (kv_caches, [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches])

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """h [T, hidden] (updated in place: every layer's attention and all but the last MLP output added);
        cos, sin [T, head_dim] float32; `meta` the "cpu" backend's CpuMetadata -> the last MLP output [T, hidden]."""
        if self._caches is None or self._caches[0] is not kv_caches or \
                any(k.data_ptr() != pk or v.data_ptr() != pv for (k, v), (pk, pv) in zip(kv_caches, self._caches[1])):
            self._bind(kv_caches)
        T = h.shape[0]
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        # What the C functions trust (built so by the runner and the backend: a cheap test, then the names)
        if not (h.dtype == self.dtype and h.is_contiguous() and h.shape == (T, self.hidden)
                and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape == sin.shape == (T, self.head_dim) and slots.dtype == torch.int64
                and slots.is_contiguous() and slots.shape == (T,) and tables is not None
                and tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
                and tables.dim() == 2 and tables.shape[0] == T and lens.shape == (T,)):
            raise ValueError(f"forward_layers: h {tuple(h.shape)} {h.dtype}, cos/sin {tuple(cos.shape)} "
                             f"{cos.dtype}, slots, tables and lengths must be the runner's and the CPU backend's "
                             f"contiguous [T] / [T, blocks] int64 tensors for T={T} rows")
        scratch = torch.empty(T * sum(self._widths), dtype=self.dtype)   # every activation of a layer, reused
        s, at, base = self.step, scratch.data_ptr(), self._elem * T
        s.rows, s.h = T, h.data_ptr()
        s.x = at
        s.qkv = at = at + base * self._widths[0]
        s.o = at = at + base * self._widths[1]
        s.attn = at = at + base * self._widths[2]
        s.gate_up = at = at + base * self._widths[3]
        s.act = at = at + base * self._widths[4]
        s.a = at = at + base * self._widths[5]
        s.cos, s.sin, s.slots = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        s.tables, s.lens, s.max_blocks = tables.data_ptr(), lens.data_ptr(), tables.shape[1]
        status = self._fn(self.kernels, self.dims, self._layers, len(self._layers), s)
        if status != 0:            # what store and attend found wrong, as their Python faces say it
            expect(status != cpu_attention.BAD_BLOCK - 10, "slot_mapping", "slots inside the pool", slots)
            expect(status != cpu_attention.BAD_SEQ_LEN, "seq_lens", "lengths from 1 to what the tables hold", lens)
            expect(status != cpu_attention.BAD_BLOCK, "block_tables", "block ids inside the pool", tables)
            raise MemoryError("the CPU attention kernel could not allocate its scratch buffers")
        offset = sum(self._widths[:6]) * T
        return scratch[offset: offset + T * self.hidden].view(T, self.hidden)
