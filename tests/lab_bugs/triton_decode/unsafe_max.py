"""Bug: the exponents use the new max directly: a fully masked row computes exp(-inf - -inf) = NaN."""
import triton
import triton.language as tl

EXPECT_HINT = "NaN"


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
    m_safe = m_new
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc
