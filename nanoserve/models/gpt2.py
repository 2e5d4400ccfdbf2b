"""GPT-2 (and its family: distilgpt2, gpt2-medium, ...) over the paged KV cache.

The architecture is the classic pre-norm transformer:

    h = wte[ids] + wpe[positions]
    for each block:  h = h + attn(ln_1(h));  h = h + mlp(ln_2(h))
    logits = ln_f(h) @ wte.T            (the LM head is tied to the embedding)

Differences from the Hugging Face implementation are only in the plumbing:
tokens of all sequences in the batch are one flat row `[T, hidden]`, and
attention reads K/V from the paged cache through `nanoserve.attention`.
Weights come from a transformers `GPT2LMHeadModel` state dict; HF stores the
projections as `Conv1D` with weight `[in, out]`, so they are transposed into
`nn.Linear` (`[out, in]`) on load.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from nanoserve.attention import AttentionMetadata, paged_attention


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)   # fused q, k, v projection
        self.out = nn.Linear(config.n_embd, config.n_embd)
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer_idx + 1)

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)   # each [T, H, D]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)            # [T, H, D]
        return self.out(o.reshape(T, -1))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.fc = nn.Linear(config.n_embd, inner)
        self.proj = nn.Linear(inner, config.n_embd)
        self.act = ACT2FN[config.activation_function]   # "gelu_new": the tanh approximation

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, h, k_cache, v_cache, meta):
        h = h + self.attn(self.ln_1(h), k_cache, v_cache, meta)
        return h + self.mlp(self.ln_2(h))


class GPT2(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.n_layer
        self.num_kv_heads = config.n_head            # no GQA in GPT-2
        self.head_dim = config.n_embd // config.n_head
        self.max_positions = config.n_positions
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight      # tied: the embedding table is the output projection

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h = self.wte(input_ids) + self.wpe(positions)
        for block, (k_cache, v_cache) in zip(self.blocks, kv_caches):
            h = block(h, k_cache, v_cache, meta)
        return self.ln_f(h)

    def compute_logits(self, hidden):
        """hidden [N, hidden] -> logits [N, vocab] through the tied embedding."""
        return self.lm_head(hidden)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers GPT2LMHeadModel state dict."""
        g = lambda name: sd[f"transformer.{name}"]  # noqa: E731
        with torch.no_grad():
            self.wte.weight.copy_(g("wte.weight"))
            self.wpe.weight.copy_(g("wpe.weight"))
            self.ln_f.weight.copy_(g("ln_f.weight"))
            self.ln_f.bias.copy_(g("ln_f.bias"))
            for i, b in enumerate(self.blocks):
                p = f"h.{i}."
                for ours, theirs in ((b.ln_1, "ln_1"), (b.ln_2, "ln_2")):
                    ours.weight.copy_(g(p + theirs + ".weight"))
                    ours.bias.copy_(g(p + theirs + ".bias"))
                # Conv1D weights are [in, out]; nn.Linear wants [out, in].
                for ours, theirs in ((b.attn.qkv, "attn.c_attn"), (b.attn.out, "attn.c_proj"),
                                     (b.mlp.fc, "mlp.c_fc"), (b.mlp.proj, "mlp.c_proj")):
                    ours.weight.copy_(g(p + theirs + ".weight").T)
                    ours.bias.copy_(g(p + theirs + ".bias"))
