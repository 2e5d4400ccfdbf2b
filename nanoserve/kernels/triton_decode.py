"""Triton paged decode attention: one new query token per sequence, K/V read through block tables.

What one program computes (grid = sequences x KV heads x splits):

    b, kv_head, split = program ids
    q      = the GROUP query heads that share kv_head          [GROUP, D]
    tokens = this split's slice of positions [start, end) of sequence b
    m, l, acc = -inf, 0, 0                                      running max, sum, output
    for each tile of BLOCK_N positions n in tokens:
        block = block_table[b, n // BLOCK_SIZE]                 the block table turns a position
        slot  = block * BLOCK_SIZE + n % BLOCK_SIZE             into an address in the paged cache
        s = q @ K[slot].T * scale                               [GROUP, BLOCK_N]
        online softmax: m' = max(m, rowmax s); p = exp(s - m')
        l = l * exp(m - m') + rowsum p;  acc = acc * exp(m - m') + p @ V[slot]
    partial_out[b, heads, split] = acc / l;  lse[b, heads, split] = m + log l

Grouped-query attention: the GROUP query heads of one KV head are computed
together, so each K/V tile is read once for all of them.

Split-K (flash decoding): with one program per (sequence, head), a batch of
a few long sequences keeps only a few GPU cores busy while each walks a long
loop. Cutting the positions into slices of SPLIT_TOKENS gives a program per
slice; `_combine_splits_kernel` then merges the partial results with their
log-sum-exps:  out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse).
The slice length is a constant, not a share of the table's width, so a
sequence's slices (and its output's bits) are the same in any batch: a CUDA
graph's batch, whose tables are padded to max_model_len (cuda_graphs.py), gives
the tokens an eager step gives.

`decode_attention` below checks its arguments, allocates and launches; it
matches `reference.decode_attention`.

Launch shape: BLOCK_N = 32 positions a tile, 8 warps, 2 pipeline stages. The
loop does little arithmetic per byte it loads, so two stages (tile n+1 in
flight while tile n is used) keep the loads going; a third stage only held
more registers and shared memory. 8 warps spread the [GROUP_PAD, D] accumulator
and the [BLOCK_N, D] tiles over twice the threads of 4, so a thread holds less
of them: at least as many warps stay resident on an SM (registers decide), and
a program has twice the loads in flight when a small batch gives too few
programs to fill the GPU. A float32 cache keeps 3 stages: with 2, ptxas keeps
two float32 shapes at 64 registers on sm_90 by spilling 4 bytes (to fit a
fourth program on the SM); with 3, no shape of the full grid spills
(`python -m nanoserve.kernels.triton_shapes --full`).
The measured registers and occupancy, before and after, are on the kernels
page (docs/concepts/kernels.md, from benchmarks/kernel_resources.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.checks import check_paged_args
from nanoserve.kernels.triton_common import load_kv_tile, online_softmax_step

NUM_WARPS = 8                    # the launch shape (module docstring: why)
NUM_STAGES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 3}   # by cache dtype
SPLIT_TOKENS = 256               # positions per split (module docstring: why a constant)


@triton.jit
def _paged_decode_kernel(
    # tensors
    q_ptr,              # [B, Hq, D]
    k_cache_ptr,        # [N, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,        # [N, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,   # [B, max_blocks] int
    seq_lens_ptr,       # [B] int: tokens in each sequence, the new one included
    part_out_ptr,       # [B, Hq, NUM_SPLITS, D] float32: each split's normalised output
    lse_ptr,            # [B, Hq, NUM_SPLITS] float32: each split's log-sum-exp
    # strides (elements)
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_btb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    # scalars
    scale,
    tokens_per_split,   # positions handled by one split (a multiple of BLOCK_N)
    window,             # 0, or a sliding window: only each sequence's last `window` positions are read
    # compile-time sizes
    GROUP: tl.constexpr,        # query heads per KV head
    GROUP_PAD: tl.constexpr,    # GROUP rounded up to a power of two >= 16 (tl.dot needs 16)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,   # tokens per KV block (the page size)
    BLOCK_N: tl.constexpr,      # positions per tile
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)    # the first position the query sees
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    start = tl.maximum(start, lo // BLOCK_N * BLOCK_N)    # tiles wholly before the window are skipped

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < GROUP          # padding rows of the group: not real heads
    mask_d = offs_d < HEAD_DIM       # padding columns when head_dim is not a power of two
    heads = kv_head * GROUP + offs_g

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)            # [GROUP_PAD, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # the last tile may run past this split's (or the sequence's) end; the first may start before the window
        mask_n = (offs_n < end) & (offs_n >= lo)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + b * stride_btb, offs_n, mask_n,
                            kv_head, offs_d, mask_d, stride_kn, stride_kt, stride_kh,
                            stride_vn, stride_vt, stride_vh, BLOCK_SIZE)                 # [BLOCK_N, D] each
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale      # [GROUP_PAD, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))                        # positions past the end
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v)

    # A split past the sequence's end (or before its window) ran no tile: l = 0, lse = -inf, so it weighs nothing.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,       # [B, Hq, NUM_SPLITS, D] float32
    lse_ptr,            # [B, Hq, NUM_SPLITS] float32
    out_ptr,            # [B, Hq, D]
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    part_row = part_out_ptr + b * stride_pb + h * stride_ph
    # Two passes over the splits in order: the largest lse, then the weighted sum. Summed one split
    # after the other, the result has the same bits however many empty splits (lse = -inf, weight 0,
    # output 0) follow the real ones, so it does not depend on how wide the block table was padded.
    lse_max = float("-inf")
    for s in range(num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_row + s))
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    total = 0.0
    for s in range(num_splits):
        weight = tl.exp(tl.load(lse_row + s) - lse_max)
        acc += weight * tl.load(part_row + s * stride_ps + offs_d, mask=mask_d, other=0.0)
        total += weight
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=mask_d)


def decode_attention(
    q: torch.Tensor,             # [B, Hq, D]
    k_cache: torch.Tensor,       # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, nb] int
    seq_lens: torch.Tensor,      # [B] int
    scale: float,
    mask: torch.Tensor | None = None,   # unused: the kernel masks by seq_lens itself (same signature as reference)
    num_splits: int | None = None,      # None: one split per SPLIT_TOKENS positions of the table
    block_n: int = 32,
    window: int = 0,                    # > 0: a sliding-window layer, each query sees its last `window` keys
) -> torch.Tensor:
    """Paged decode attention with Triton; same contract as `reference.decode_attention`."""
    B, Hq, D = q.shape
    check_paged_args(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    if seq_lens.shape != (B,) or block_tables.shape[0] != B:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} and block_tables {tuple(block_tables.shape)} "
                         f"must have one row per query ({B})")
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    max_len = block_tables.shape[1] * bs
    if num_splits is None:
        tokens_per_split = triton.cdiv(SPLIT_TOKENS, block_n) * block_n
        num_splits = max(1, triton.cdiv(max_len, tokens_per_split))
    else:
        tokens_per_split = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    group = Hq // Hkv
    d_pad = triton.next_power_of_2(D)
    _paged_decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        scale, tokens_per_split, window,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=bs, BLOCK_N=block_n,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES[k_cache.dtype],
    )
    out = torch.empty_like(q)
    if num_splits == 1:          # one split: its output is already normalised
        return out.copy_(part[:, :, 0])
    _combine_splits_kernel[(B, Hq)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits, HEAD_DIM=D, HEAD_DIM_PAD=d_pad,
    )
    return out
