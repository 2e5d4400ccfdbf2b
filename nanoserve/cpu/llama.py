"""Llama's forward on a CPU in fewer, larger steps: the fast path beside models/llama.py.

models/llama.py is the model to read. This module computes the same thing,
arranged for a CPU, where a decode step has only ~32 rows and each torch op's
fixed cost (the dispatch, a fresh output tensor: about 10 us here) adds up
over 25 small ops per layer. Per layer:

    x = rmsnorm(h += a)              a: the previous layer's MLP output   C call 1
    qkv = x @ [Wq | Wk | Wv].T       one matmul instead of three
    rope(q, k) in place in qkv                                             C call 2
    o = paged_attention(q, k, v)     the same call (the backend, or a lab's ops)
    x = rmsnorm(h += o @ Wo.T)                                             C call 3
    a = silu(x @ Wg.T) * (x @ Wu.T)  one matmul for [gate | up]            C call 4
        @ Wd.T                       ... and the down projection

* The projections that read the same input are merged: q, k, v into one
  matmul and gate, up into another, so 4 matmuls per layer instead of 7, each
  larger (vLLM's QKVParallelLinear and MergedColumnParallelLinear do the
  same). The matmuls run from weights packed once into panels by our own
  C kernel (cpu/linear.py's PanelLinear: cpu/matmul.c for float32,
  cpu/matmul_bf16.c for bf16 on a CPU with AVX512-BF16), or oneDNN-packed
  (CpuLinear) where that cannot be built.
* RMSNorm with the residual add before it, RoPE, and silu(gate) * up are one
  C call each (cpu/ops.c) instead of 4 to 10 torch ops.
* The residual stream h is one tensor, updated in place.

Llama (Mistral's sliding window too), Qwen2 (its q/k/v biases ride in the
merged matmul) and Qwen3 (its QK-norm is two torch calls after that matmul);
not Gemma 3, whose extra norms and scalings keep models/gemma3.py's forward.
Float32 models, and bf16 ones on a CPU with bf16 units (AVX512-BF16, AMX:
there ops.c's bf16 build rounds to bf16 where llama.py does), on one
process (no tensor-parallel shards). The runner uses it on a CPU on the
"fast" path (EngineConfig.path); tests/test_cpu_llama.py checks it against
llama.py. The loaded model is not changed: this holds
packed copies of its matmul weights and shares everything else.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.attention import AttentionMetadata, layer_meta, paged_attention
from nanoserve.cpu import matmul as cpu_matmul
from nanoserve.cpu import ops as cpu_ops
from nanoserve.cpu.backend import CpuMetadata
from nanoserve.cpu.forward import OneCall
from nanoserve.cpu.linear import CpuLinear, PanelLinear, can_pack_dtype
from nanoserve.cpu.matmul import CpuMatmul
from nanoserve.cpu.ops import CpuOps
from nanoserve.models.llama import Llama, LlamaAttention, LlamaLayer, LlamaMLP, RMSNorm
from nanoserve.models.qwen2 import Qwen2
from nanoserve.models.qwen3 import Qwen3, Qwen3Attention


def stacked(*linears: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output is the given layers' outputs side by side (their weights stacked)."""
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    merged = nn.utils.skip_init(nn.Linear, linears[0].in_features, sum(lin.out_features for lin in linears),
                                bias=bias is not None)
    merged.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    if bias is not None:
        merged.bias = nn.Parameter(bias, requires_grad=False)
    return merged


def projection(linear: nn.Linear, mm: CpuMatmul | None) -> nn.Module:
    """The matmul of one (merged) projection: matmul.c's panels, or oneDNN's packing without them."""
    return CpuLinear(linear, upcast=False, pack=True) if mm is None else PanelLinear(linear, mm)


def supports(model: nn.Module) -> bool:
    """A whole (unsharded) Llama built of llama.py's own modules, every projection a plain nn.Linear, in float32
    (or bf16 where the CPU has bf16 units: `can_pack_dtype`).

    Anything replaced or subclassed (a sharded layer, a student's module) keeps the model's own forward:
    this module would skip it silently otherwise."""
    if type(model) not in (Llama, Qwen2, Qwen3) or getattr(model, "tp_size", 1) != 1:
        return False
    if not can_pack_dtype(model.lm_head.weight.dtype) or type(model.model.norm) is not RMSNorm:
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (type(layer) is LlamaLayer, type(attn) in (LlamaAttention, Qwen3Attention), type(mlp) is LlamaMLP,
                 type(layer.input_layernorm) is RMSNorm, type(layer.post_attention_layernorm) is RMSNorm)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *mlp.children())
        norms = (attn.q_norm, attn.k_norm) if type(attn) is Qwen3Attention else ()
        if not all(parts) or not all(type(p) is nn.Linear for p in projections) or \
                not all(type(n) is RMSNorm for n in norms):
            return False
    return True


class CpuLlamaLayer(nn.Module):
    def __init__(self, layer: LlamaLayer, ops: CpuOps, mm: CpuMatmul | None) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.window = attn.scale, attn.window
        self.qkv = projection(stacked(attn.q_proj, attn.k_proj, attn.v_proj), mm)
        self.o = projection(attn.o_proj, mm)
        self.gate_up = projection(stacked(mlp.gate_proj, mlp.up_proj), mm)
        self.down = projection(mlp.down_proj, mm)
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm   # shared
        self.qk_norms = (attn.q_norm, attn.k_norm) if type(attn) is Qwen3Attention else None   # Qwen3's QK-norm
        # What forward reads 30 times a step, as plain attributes (a submodule's or parameter's lookup
        # goes through nn.Module.__getattr__, about 1 us each).
        self.norm1_args = (self.norm1.weight, self.norm1.eps)
        self.norm2_args = (self.norm2.weight, self.norm2.eps)

    def forward(self, h, a, cos, sin, k_cache, v_cache, meta: AttentionMetadata, check: bool = True):
        """h += a, then this layer's attention (added to h); returns its MLP output (the next layer adds it).

        check=False skips the C calls' layout checks: CpuLlama passes it after the first layer, whose
        calls checked the same layouts (every layer's tensors have the same shapes, all built here).

        The projections are called as `.forward(x)`, not `(x)`: nn.Module's __call__ (hook handling)
        costs about 8 us a call, and at a decode step a CPU spends that 121 times."""
        T, Hq, Hkv = h.shape[0], self.num_heads, self.num_kv_heads
        x = self.ops.add_rms_norm(h, a, *self.norm1_args, check=check)
        heads = self.qkv.forward(x).view(T, Hq + 2 * Hkv, self.head_dim)   # [T, q heads | k heads | v heads, D]
        if self.qk_norms is not None:                                      # Qwen3: each q and k head normalised
            q_norm, k_norm = self.qk_norms
            heads[:, :Hq] = q_norm.forward(heads[:, :Hq])
            heads[:, Hq : Hq + Hkv] = k_norm.forward(heads[:, Hq : Hq + Hkv])
        self.ops.rotary_(heads[:, : Hq + Hkv], cos, sin, check=check)      # positions into q and k, in place
        q, k, v = heads.split([Hq, Hkv, Hkv], dim=1)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, window=self.window)
        x = self.ops.add_rms_norm(h, self.o.forward(o.reshape(T, -1)), *self.norm2_args, check=check)
        return self.down.forward(self.ops.silu_mul(self.gate_up.forward(x), check=check))


class CpuLlama(nn.Module):
    """The runner's view of a Llama on a CPU: Llama's forward signature, its results to float32 (bf16) rounding."""

    def __init__(self, model: Llama, ops: CpuOps, mm: CpuMatmul | None = None) -> None:
        super().__init__()
        self.ops = ops
        # the C file whose panels multiply ("matmul.c", "matmul_bf16.c"), or "" (oneDNN's packing)
        self.panels = "" if mm is None else cpu_matmul.SOURCES[mm.dtype].name
        self.num_layers, self.num_kv_heads = model.num_layers, model.num_kv_heads
        self.head_dim, self.max_positions = model.head_dim, model.max_positions
        self.embed_tokens, self.rotary, self.norm = model.model.embed_tokens, model.rotary, model.model.norm
        self.layers = nn.ModuleList(CpuLlamaLayer(layer, ops, mm) for layer in model.model.layers)
        self.lm_head = projection(model.lm_head, mm)
        # Every layer's C calls made from C in one call (cpu/forward.c), for steps the "cpu" attention backend
        # prepared: set by cpu/__init__.py's fast_path when that backend runs (OneCall.build, None where a layer
        # calls torch: oneDNN matmuls, Qwen3's QK-norm). None runs the Python loop below (tests compare the two).
        self.one_call: OneCall | None = None

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)      # the residual stream: a fresh tensor, updated in place below
        cos, sin = self.rotary(positions)     # [T, D] each, shared by all layers
        if self.one_call is not None and type(meta) is CpuMetadata:   # (KV cache groups: a list, the loop)
            a = self.one_call.run(h, cos, sin, kv_caches, meta)    # the loop below, in C: the same calls
        else:
            a = None                          # the previous layer's MLP output, not yet added to h
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                a = layer(h, a, cos, sin, k_cache, v_cache, layer_meta(meta, i), check=i == 0)   # layer 0 checks
        return self.ops.add_rms_norm(h, a, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden):
        return self.lm_head.forward(hidden)


def cpu_llama_view(model: nn.Module, dtype: torch.dtype = torch.float32) -> CpuLlama | None:
    """A CpuLlama of `model` (weights of `dtype`), or None where it does not apply (see `supports`) or ops.c
    cannot be built.

    The matmuls are matmul.c's (float32) or matmul_bf16.c's (bf16, AVX512-BF16) where that builds (it needs
    the same C compiler), oneDNN's otherwise."""
    if not supports(model) or model.lm_head.weight.dtype != dtype:
        return None
    ops = cpu_ops.load(dtype)                # None (with one warning) if it cannot be built here
    mm = cpu_matmul.load(dtype)
    return None if ops is None else CpuLlama(model, ops, mm)
