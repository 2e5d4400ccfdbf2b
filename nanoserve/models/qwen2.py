"""Qwen2 and Qwen2.5: Llama with a bias on the q, k and v projections.

    Llama                         Qwen2
    q, k, v = x @ W.T             q, k, v = x @ W.T + b     (o_proj still has no bias)

Everything else is llama.py's: RMSNorm, RoPE (a base of 1e6), grouped-query
attention (Qwen2.5-0.5B keeps 2 KV heads for 14 query heads, 7:1; the 1.5B
model 2 for 12, 6:1), SwiGLU. The small models tie the embedding and the
output projection (`tie_word_embeddings`), the larger ones do not; llama.py
handles both. Weight names are the same as Llama's.
"""

from __future__ import annotations

from torch import nn

from nanoserve.models.llama import Llama, LlamaAttention, LlamaLayer


class Qwen2(Llama):
    def make_layer(self, config, head_dim: int, window: int | None) -> nn.Module:
        return LlamaLayer(config, head_dim, LlamaAttention(config, head_dim, qkv_bias=True, o_bias=False,
                                                           window=window))
