"""Attention over the paged KV cache: the one call every model layer makes.

The runner flattens a mixed batch into one row of tokens, decodes first:

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      d = decode, p = prefill chunk
              one each    chunk of seq 3   chunk of seq 4

and describes it with `AttentionMetadata`. A layer computes q, k, v for all
those tokens, then `paged_attention` writes k, v into the cache at
`slot_mapping` and computes attention for each part, reading K/V back only
through block tables. Which kernels do the work is the backend's business:
`kernels/reference.py` (torch, any device) or `kernels/triton_*.py` (Triton:
on a GPU, or on CPU under the Triton interpreter for tests and lessons).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoserve.kernels import reference


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill chunk inside the flat token row."""

    query_start: int             # index of its first token in the flat row
    num_query: int               # tokens in the chunk
    context_len: int             # cached prefix + chunk
    block_table: torch.Tensor    # [ceil(context_len / bs)] int64
    mask: torch.Tensor           # [num_query, context_len] bool causal mask (built once per step)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64: cache slot of every token in the row
    num_decodes: int                      # the first num_decodes tokens are one decode each
    decode_block_tables: torch.Tensor     # [num_decodes, nb] int64, padded
    decode_seq_lens: torch.Tensor         # [num_decodes] int64, new token included
    decode_mask: torch.Tensor             # [num_decodes, 1, 1, nb * bs] bool: which gathered slots are real
    prefills: list[PrefillChunk] = field(default_factory=list)
    backend: str = "torch"                # "torch" (kernels/reference.py) or "triton" (kernels/triton_*.py)
    # The prefill chunks again as tensors, for the Triton kernel that runs them all in one launch.
    prefill_block_tables: torch.Tensor | None = None   # [C, nb] padded
    prefill_query_start: torch.Tensor | None = None    # [C]
    prefill_query_len: torch.Tensor | None = None      # [C]
    prefill_context_len: torch.Tensor | None = None    # [C]


def paged_attention(
    q: torch.Tensor,        # [T, Hq, D]
    k: torch.Tensor,        # [T, Hkv, D]
    v: torch.Tensor,        # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] this layer's cache
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:          # [T, Hq, D]
    if meta.backend == "triton":
        return _triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    # 1. Write this step's K/V first, so every query below can see its own token.
    reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    # 2. Decodes: one query each, batched together.
    nd = meta.num_decodes
    if nd:
        out[:nd] = reference.decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, meta.decode_mask
        )
    # 3. Prefill chunks: causal over (cached prefix + chunk), one sequence at a time.
    for chunk in meta.prefills:
        s, e = chunk.query_start, chunk.query_start + chunk.num_query
        out[s:e] = reference.prefill_attention(
            q[s:e], k_cache, v_cache, chunk.block_table, chunk.context_len, scale, chunk.mask
        )
    return out


def _triton_paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The same three parts with the Triton kernels: store, batched decode, all prefill chunks in one launch."""
    from nanoserve.kernels import triton_cache, triton_decode, triton_prefill

    triton_cache.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = triton_decode.decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
    if meta.prefills:
        triton_prefill.prefill_attention(
            q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start, meta.prefill_query_len,
            meta.prefill_context_len, scale, max_query_len=max(c.num_query for c in meta.prefills), out=out)
    return out


def prepare_backend(config) -> str:
    """`config` is an EngineConfig. Returns "torch" or "triton"."""

    """Pick the attention backend; Triton on a CPU runs under its interpreter (set before import)."""
    backend = config.resolved_backend()
    if backend == "triton":
        import importlib.util
        import os

        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' needs triton: pip install triton")
        if not config.device.startswith("cuda"):
            os.environ.setdefault("TRITON_INTERPRET", "1")
            import triton.language as tl

            # The interpreter must be on before triton is first imported (transformers imports it),
            # or triton's own helpers stay compiled-only.
            if type(tl.zeros).__name__ != "InterpretedFunction":
                raise ValueError("attention_backend='triton' on CPU runs under the Triton interpreter: "
                                 "start Python with TRITON_INTERPRET=1 in the environment")
    return backend
