"""Reference paged attention in plain torch: the contract every kernel must match.

The KV cache of one layer is two tensors

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]

and a sequence finds its tokens through its block table: token i of the
sequence lives in physical block `block_table[i // block_size]` at offset
`i % block_size`, i.e. at flat *slot* `block_table[i // bs] * bs + i % bs`.
There is no contiguous per-sequence cache anywhere: these functions gather
K/V through the block table every time they run.

Three operations:

* `store_kv`        write new K/V rows at their slots
* `decode_attention` one query token per sequence, many sequences at once
* `prefill_attention` a chunk of queries of one sequence, attending causally
                      to the cached prefix *and* to the chunk itself

Grouped-query attention: query head h reads KV head h // (Hq // Hkv); torch's
`scaled_dot_product_attention(enable_gqa=True)` does that mapping for us.
These run on any device; on CPU they are what the engine uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,             # [T, Hkv, D] new keys
    v: torch.Tensor,             # [T, Hkv, D] new values
    k_cache: torch.Tensor,       # [N, bs, Hkv, D]
    v_cache: torch.Tensor,       # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 flat slot of each new token
) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t] (and the same for v)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Read whole blocks through block tables.

    cache [N, bs, Hkv, D], block_tables [B, nb] -> [B, nb * bs, Hkv, D]
    Position j of row b is token j of sequence b (valid while j < its length).
    """
    b, nb = block_tables.shape
    _, bs, h, d = cache.shape
    # index_select copies whole blocks in one pass (about twice as fast as cache[block_tables] on CPU).
    blocks = cache.index_select(0, block_tables.reshape(-1))    # [B * nb, bs, Hkv, D]
    return blocks.view(b, nb * bs, h, d)


def decode_attention(
    q: torch.Tensor,             # [B, Hq, D] the newest token of each sequence
    k_cache: torch.Tensor,       # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, nb] int64, padded with any valid id past each sequence's end
    seq_lens: torch.Tensor,      # [B] int64 tokens in each sequence, the new one included
    scale: float,
    mask: torch.Tensor | None = None,   # [B, 1, 1, L] from decode_mask(), to build it once per step
    compute_dtype: torch.dtype | None = None,   # multiply in this dtype (None: the cache's)
) -> torch.Tensor:               # [B, Hq, D]
    dt = compute_dtype or q.dtype
    k = gather_kv(k_cache, block_tables).transpose(1, 2).to(dt)   # [B, Hkv, L, D]
    v = gather_kv(v_cache, block_tables).transpose(1, 2).to(dt)
    if mask is None:
        mask = decode_mask(seq_lens, k.shape[2])
    out = F.scaled_dot_product_attention(
        q.to(dt).unsqueeze(2),                     # [B, Hq, 1, D]
        k, v, attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.squeeze(2).to(q.dtype)


def decode_mask(seq_lens: torch.Tensor, L: int) -> torch.Tensor:
    """[B, 1, 1, L] bool: only the first seq_lens[b] positions of row b are real tokens;
    the rest are padding blocks (or unused slots of the last block)."""
    valid = torch.arange(L, device=seq_lens.device)[None, :] < seq_lens[:, None]   # [B, L]
    return valid[:, None, None, :]


def prefill_attention(
    q: torch.Tensor,             # [Tq, Hq, D] queries of the chunk: tokens [ctx - Tq, ctx)
    k_cache: torch.Tensor,       # [N, bs, Hkv, D] (the chunk's own K/V already stored)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,   # [nb] int64 blocks covering the first ctx tokens
    context_len: int,            # ctx: cached prefix + this chunk
    scale: float,
    mask: torch.Tensor | None = None,   # [Tq, ctx] from prefill_mask(), to build it once per step
    compute_dtype: torch.dtype | None = None,   # multiply in this dtype (None: the cache's)
) -> torch.Tensor:               # [Tq, Hq, D]
    dt = compute_dtype or q.dtype
    k = gather_kv(k_cache, block_table[None])[:, :context_len].transpose(1, 2).to(dt)   # [1, Hkv, ctx, D]
    v = gather_kv(v_cache, block_table[None])[:, :context_len].transpose(1, 2).to(dt)
    if mask is None:
        mask = prefill_mask(q.shape[0], context_len, q.device)
    # A leading batch axis of 1: with 4-D inputs torch's CPU flash kernel runs (2x faster than
    # the 3-D call, which falls back to the unfused math path).
    out = F.scaled_dot_product_attention(
        q.to(dt).transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )                                               # [1, Hq, Tq, D]
    return out[0].transpose(0, 1).to(q.dtype)


def prefill_mask(num_q: int, context_len: int, device) -> torch.Tensor:
    """[Tq, ctx] bool. Query i sits at absolute position ctx - Tq + i and may see keys
    0..that position: the whole cached prefix plus the chunk's own tokens up to itself."""
    q_pos = torch.arange(context_len - num_q, context_len, device=device)
    k_pos = torch.arange(context_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]
