"""Gemma 3 (text): Llama with more norms, two kinds of layers and a few scalings.

    h = embed[ids] * sqrt(hidden)
    for each layer:  h = h + post_attn_norm(attn(input_norm(h)))
                     h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))
    logits = norm(h) @ embed.T                  (capped: cap * tanh(logits / cap), if configured)

What changes from llama.py:
* RMSNorm scales by (1 + w), not w (the weights are stored as offsets from 1), and rounds to the
  model's dtype after the multiply, not before.
* Four norms per layer: after attention and after the MLP as well as before each.
* The embedding is multiplied by sqrt(hidden_size) (rounded to the model's dtype, as transformers does).
* QK-norm, as in Qwen3: each query and key head is normalised before RoPE.
* The attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
* Local and global layers: most layers attend only to the last `sliding_window` tokens
  ("sliding_attention" in config.layer_types; five of every six in the released models) and use
  RoPE with base 10 000; the rest attend to everything and use their own base (1 000 000).
* The MLP's activation is the tanh approximation of GELU (GeGLU), not SiLU.
* Head size 256 whatever the hidden size, and one KV head in the small models (multi-query).

Windowed layers need a backend with window masks (kernels/torch_backend.py). The cache still holds
every token of a windowed layer: freeing blocks that left the window is the KV cache groups' job.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from nanoserve.attention import AttentionMetadata, layer_meta
from nanoserve.models.llama import Llama, LlamaAttention, LlamaMLP, Rotary


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + w), in float32, then rounded to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        out = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, head_dim: int, window: int | None) -> None:
        super().__init__(config, head_dim, window=window)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Gemma3MLP(LlamaMLP):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.act = ACT2FN[config.hidden_activation]    # "gelu_pytorch_tanh"

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma3Layer(nn.Module):
    def __init__(self, config, head_dim: int, window: int | None) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Gemma3Attention(config, head_dim, window)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache,
                                                             meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3(Llama):
    def __init__(self, config) -> None:
        for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(config, name, None):
                raise ValueError(f"Gemma 3 config field {name}={getattr(config, name)!r} is not supported")
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        self.logit_cap = getattr(config, "final_logit_softcapping", None)
        self.local = [t == "sliding_attention" for t in config.layer_types]   # which RoPE table each layer uses
        self.rotary = Rotary(config, self.head_dim, "full_attention")
        self.rotary_local = Rotary(config, self.head_dim, "sliding_attention")

    def make_layer(self, config, head_dim: int, window: int | None) -> nn.Module:
        return Gemma3Layer(config, head_dim, window)

    def make_norm(self, dim: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(dim, eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        tables = {False: self.rotary(positions), True: self.rotary_local(positions)}   # (cos, sin) by kind
        for i, (layer, local, (k_cache, v_cache)) in enumerate(zip(self.model.layers, self.local, kv_caches)):
            h = layer(h, *tables[local], k_cache, v_cache, layer_meta(meta, i))   # (its KV cache group's tables)
        return self.model.norm(h)

    def compute_logits(self, hidden):
        logits = self.lm_head(hidden)
        if self.logit_cap:
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        return logits
