"""Two pieces both attention kernels share: reading a K/V tile through a block table,
and one step of the online softmax.

load_kv_tile, for positions n of one sequence (a tile of BLOCK_N of them):

    block  = block_table_row[n // BLOCK_SIZE]        which physical block holds position n
    slot   = block * BLOCK_SIZE + n % BLOCK_SIZE      where in the cache
    K, V   = k_cache[slot, kv_head], v_cache[slot, kv_head]      [BLOCK_N, D] each

online_softmax_step, given scores s [rows, BLOCK_N] of a new tile (-inf where masked):

    m' = max(m, rowmax s);   p = exp(s - m');   alpha = exp(m - m')
    l' = l * alpha + rowsum p;   acc' = acc * alpha + p @ V

so after the last tile acc / l is softmax(all scores) @ V without ever holding
all the scores at once. A row that has seen only masked scores keeps m = -inf;
`m_safe` keeps its p and alpha at 0 instead of NaN.

Every `tl.dot` in these kernels passes input_precision="ieee": on a GPU a float32
dot otherwise runs on tensor cores in tf32, which keeps 10 bits of each input's
mantissa, and a float32 model's greedy tokens would drift from the torch reference.
float16 and bfloat16 inputs are multiplied exactly either way.
"""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr,
    table_row_ptr,               # this sequence's block table row
    offs_n, mask_n,              # [BLOCK_N] positions, and which of them exist
    kv_head, offs_d, mask_d,     # [D_PAD] head-dim offsets, and which are real (not padding)
    stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
    BLOCK_SIZE: tl.constexpr,
):
    block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
    offset = offs_n % BLOCK_SIZE
    mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kn + offset[:, None] * stride_kt
                + kv_head * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vn + offset[:, None] * stride_vt
                + kv_head * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v):
    """Fold one tile of scores s [rows, BLOCK_N] and values v [BLOCK_N, D] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
    return m_new, l_i, acc
