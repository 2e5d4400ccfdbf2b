"""Qwen3: Llama with "QK-norm", an RMSNorm of every query and key head before RoPE.

    Llama                         Qwen3
    q = x @ Wq.T                  q = rmsnorm_per_head(x @ Wq.T)     one weight of head_dim, shared by
    k = x @ Wk.T                  k = rmsnorm_per_head(x @ Wk.T)     the heads (q_norm, k_norm)

Normalising q and k keeps the attention logits q.k in a bounded range however
large the activations grow. The head size is the config's `head_dim` (128 in
Qwen3-0.6B, whose hidden size 1024 over 16 heads would give 64), so the
projections are wider than hidden_size. No bias on the projections (unlike
Qwen2). Everything else is llama.py's.
"""

from __future__ import annotations

from torch import nn

from nanoserve.models.llama import Llama, LlamaAttention, LlamaLayer, RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, head_dim: int, window: int | None = None) -> None:
        super().__init__(config, head_dim, window=window)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v     # over the last axis: each head on its own


class Qwen3(Llama):
    def make_layer(self, config, head_dim: int, window: int | None) -> nn.Module:
        return LlamaLayer(config, head_dim, Qwen3Attention(config, head_dim, window=window))
