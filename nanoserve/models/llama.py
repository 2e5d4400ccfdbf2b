"""Llama family (Llama 2/3, TinyLlama, SmolLM2, Mistral) over the paged KV cache.

    h = embed[ids]
    for each layer:  h = h + attn(rmsnorm(h));  h = h + mlp(rmsnorm(h))
    logits = rmsnorm(h) @ lm_head.T

What sets it apart from GPT-2:
* RMSNorm instead of LayerNorm (no mean, no bias), computed in float32.
* Rotary position embeddings (RoPE) on q and k instead of a position table;
  the frequencies come from transformers' RoPE helpers, so Llama-3 style
  `rope_scaling` works exactly as in Hugging Face.
* Grouped-query attention: fewer KV heads than query heads. The cache stores
  only the KV heads, which is the point: SmolLM2-135M keeps 3 KV heads for
  9 query heads, a third of the KV memory.
* SwiGLU MLP: down(silu(gate(x)) * up(x)).
Parameter names follow Hugging Face, so weights load with `load_state_dict`.

The other families are small deltas from this one (qwen2.py, qwen3.py,
gemma3.py): they reuse these modules and replace only what differs. A layer
may attend over a sliding window (`layer_windows`): its queries see only the
last `window` keys, as transformers masks them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoserve.attention import AttentionMetadata, layer_meta, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        # x / sqrt(mean(x^2) + eps) in float32: torch's rms_norm computes exactly HF's
        # x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), in fewer passes over x.
        x = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: it attends to every earlier token), as transformers reads the config:
    `layer_types` names the "sliding_attention" layers; without it a `sliding_window` covers every layer
    (Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * config.num_hidden_layers
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


class Rotary(nn.Module):
    """cos/sin tables for RoPE, evaluated at arbitrary positions.

    `layer_type`: for configs whose `rope_parameters` hold one entry per kind of layer (Gemma 3's
    "sliding_attention" and "full_attention", each with its own base)."""

    def __init__(self, config, head_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if layer_type is not None:
            rope = rope[layer_type]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:
            extra = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
        self.register_buffer("inv_freq", inv_freq, persistent=False)   # [D/2]

    def forward(self, positions):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]     # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                           # [T, D]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rotary(x, cos, sin):
    """x [T, H, D]: rotate each (i, i + D/2) pair by its position's angle (HF's rotate_half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # broadcast over heads
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    """`qkv_bias`, `o_bias`: biases on the q/k/v and output projections (Llama: `attention_bias` on all four;
    Qwen2: on q, k, v only). `window`: this layer's sliding window, or None."""

    def __init__(self, config, head_dim: int, qkv_bias: bool | None = None, o_bias: bool | None = None,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=bias if o_bias is None else o_bias)
        self.scale = head_dim**-0.5
        self.window = window

    def project(self, x):
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D] (QK-norm models normalise q and k here)."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.project(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)   # positions go into q, k (not v)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, config, head_dim: int, attn: nn.Module | None = None) -> None:
        """`attn`: this layer's attention module (a family's own; LlamaAttention when None)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, head_dim) if attn is None else attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    """Everything but the head; named `model` below to match HF's parameter names."""

    def __init__(self, config, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class Llama(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.max_positions = config.max_position_embeddings
        self.sliding_windows = layer_windows(config)     # per layer: its window, or None
        layers = [self.make_layer(config, head_dim, w) for w in self.sliding_windows]
        self.model = LlamaBody(config, layers, self.make_norm(config.hidden_size, config.rms_norm_eps))
        self.rotary = Rotary(config, head_dim)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:   # one tensor, two uses: the embedding table is the output projection
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, config, head_dim: int, window: int | None) -> nn.Module:
        """One decoder layer (a family overrides this to use its own attention or layer)."""
        return LlamaLayer(config, head_dim, LlamaAttention(config, head_dim, window=window))

    def make_norm(self, dim: int, eps: float) -> nn.Module:
        return RMSNorm(dim, eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)          # [T, D] each, shared by all layers
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
            h = layer(h, cos, sin, k_cache, v_cache, layer_meta(meta, i))   # (its KV cache group's tables)
        return self.model.norm(h)

    def compute_logits(self, hidden):
        """hidden [N, hidden] -> logits [N, vocab]."""
        return self.lm_head(hidden)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers LlamaForCausalLM state dict (same names)."""
        sd = {k: v for k, v in sd.items() if not (self.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = self.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not (self.tie_word_embeddings and k == "lm_head.weight")]
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"weights do not match the {type(self).__name__} architecture: missing {missing}, "
                             f"unexpected {unexpected}")
