"""Triton paged prefill ("extend") attention: a chunk of new queries over a cached prefix and itself.

Chunked prefill and prefix-cache hits both need this: the chunk's queries sit
at positions [ctx - q_len, ctx) of a sequence whose first ctx - q_len tokens
already have K/V in the paged cache (the chunk's own K/V are stored before
the call). Each query attends causally to everything up to its own position.

What one program computes (grid = chunks x query heads x query tiles):

    c, h, mt = program ids
    rows  = queries mt * BLOCK_M .. + BLOCK_M of chunk c       (absolute positions q_pos)
    q     = Q[query_start[c] + rows, h]                          [BLOCK_M, D]
    m, l, acc = -inf, 0, 0
    for each tile of BLOCK_N key positions n < min(ctx, last q_pos + 1):
        slot = block_table[c, n // BLOCK_SIZE] * BLOCK_SIZE + n % BLOCK_SIZE
        s = q @ K[slot, h // GROUP].T * scale,  -inf where n > q_pos   (causal)
        online softmax update of m, l, acc with V[slot]
    out[rows, h] = acc / l

Tiles of keys past the tile's last query position are skipped entirely (the
causal mask would zero them), which halves the work of a long chunk.
`prefill_attention` checks, allocates and launches; it matches
`reference.prefill_attention` applied to every chunk. It launches with 8 warps
and 2 pipeline stages, for the decode kernel's reasons (triton_decode.py): at
head_dim 128 that takes a bf16 program from 96 to about 70 registers a thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.checks import check_int_vector, check_paged_args
from nanoserve.kernels.triton_common import load_kv_tile, online_softmax_step

NUM_WARPS, NUM_STAGES = 8, 2     # the launch shape (module docstring: why)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,              # [T, Hq, D] all chunks' queries, flat
    k_cache_ptr,        # [N, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,   # [C, max_blocks] int
    query_start_ptr,    # [C] first row of each chunk in q
    query_len_ptr,      # [C] rows in each chunk
    context_len_ptr,    # [C] cached prefix + chunk
    out_ptr,            # [T, Hq, D]
    stride_qt, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_btc,
    stride_ot, stride_oh,
    scale,
    window,             # 0, or a sliding window: a query sees only keys less than `window` positions behind
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,      # query rows per program
    BLOCK_N: tl.constexpr,      # key positions per tile
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_start = tl.load(query_start_ptr + c)
    q_len = tl.load(query_len_ptr + c)
    ctx = tl.load(context_len_ptr + c)
    kv_head = h // GROUP

    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_m = offs_m < q_len          # rows past the chunk's end (the last tile, or a tile of a shorter chunk)
    mask_d = offs_d < HEAD_DIM
    q_pos = ctx - q_len + offs_m     # absolute position of each query row
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)           # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # Keys beyond the last query row of this tile can never be seen: stop there.
    end = tl.minimum(ctx, ctx - q_len + (mt + 1) * BLOCK_M)
    # ... and with a window, keys before the tile's first query row's window are never seen: start there.
    lo = tl.where(window > 0, tl.maximum(ctx - q_len + mt * BLOCK_M - window + 1, 0), 0)
    for n0 in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx        # the last tile may run past the context
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + c * stride_btc, offs_n, mask_n,
                            kv_head, offs_d, mask_d, stride_kn, stride_kt, stride_kh,
                            stride_vn, stride_vt, stride_vh, BLOCK_SIZE)                 # [BLOCK_N, D] each
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale        # [BLOCK_M, BLOCK_N]
        # Causal: key position n is visible to a query at q_pos when n <= q_pos.
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        visible = visible & ((window == 0) | (offs_n[None, :] > q_pos[:, None] - window))   # sliding window
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_attention(
    q: torch.Tensor,             # [T, Hq, D] the chunks' queries, concatenated
    k_cache: torch.Tensor,       # [N, bs, Hkv, D] (the chunks' own K/V already stored)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [C, nb] int: each chunk's sequence's block table, padded
    query_start: torch.Tensor,   # [C] int
    query_len: torch.Tensor,     # [C] int
    context_len: torch.Tensor,   # [C] int
    scale: float,
    max_query_len: int | None = None,
    block_m: int = 16,
    block_n: int = 32,
    out: torch.Tensor | None = None,
    window: int = 0,             # > 0: a sliding-window layer, each query sees keys less than `window` behind
) -> torch.Tensor:
    """Paged prefill attention for several chunks in one launch. Writes rows of `out` (new if None)."""
    check_paged_args(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)
    C = block_tables.shape[0]
    for name, t in (("query_start", query_start), ("query_len", query_len), ("context_len", context_len)):
        check_int_vector(name, t, C, q.device)
    if max_query_len is None:
        max_query_len = int(query_len.max()) if C else 0
    T, Hq, D = q.shape
    out = torch.empty_like(q) if out is None else out
    if C == 0 or max_query_len == 0:
        return out
    q = q.contiguous()
    _paged_prefill_kernel[(C, Hq, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, block_tables, query_start, query_len, context_len, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale, window,
        GROUP=Hq // k_cache.shape[2], HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
