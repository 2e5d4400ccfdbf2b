"""The triton-decode lab's probe kernels: `online_softmax_step` on hand-made tiles, nothing else.

`step_kernel` runs one step on given (m, l, acc) and one tile; `fold_kernel`
folds TILES tiles of scores s [R, N] and values v [N, D] from the start and
stores acc / l. So a student's step is checked on its own (a fully masked
tile, say) before it runs inside the decode and prefill kernels.
triton_kernels.py loads this file with the student's step in place of
triton_common's, as it loads those kernels. It lives in a file of its own
(not a string) because Triton compiles a kernel for a GPU from its source
file (tests/test_triton_compile.py compiles these too).
"""

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import load_kv_tile, online_softmax_step  # noqa: F401 (loaded like the kernels)


@triton.jit
def fold_kernel(s_ptr, v_ptr, out_ptr, TILES: tl.constexpr, R: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    offs_r, offs_n, offs_d = tl.arange(0, R), tl.arange(0, N), tl.arange(0, D)
    m = tl.full([R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, D], dtype=tl.float32)
    for t in range(TILES):
        s = tl.load(s_ptr + t * R * N + offs_r[:, None] * N + offs_n[None, :])    # tile t's scores [R, N]
        v = tl.load(v_ptr + t * N * D + offs_n[:, None] * D + offs_d[None, :])    # and values [N, D]
        m, l, acc = online_softmax_step(m, l, acc, s, v)
    tl.store(out_ptr + offs_r[:, None] * D + offs_d[None, :], acc / l[:, None])


@triton.jit
def step_kernel(m_ptr, l_ptr, acc_ptr, s_ptr, v_ptr, m_out, l_out, acc_out,
                R: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    # One online_softmax_step on given (m, l, acc) and a tile (s, v); store what it returns.
    offs_r, offs_n, offs_d = tl.arange(0, R), tl.arange(0, N), tl.arange(0, D)
    m = tl.load(m_ptr + offs_r)
    l = tl.load(l_ptr + offs_r)
    acc = tl.load(acc_ptr + offs_r[:, None] * D + offs_d[None, :])
    s = tl.load(s_ptr + offs_r[:, None] * N + offs_n[None, :])
    v = tl.load(v_ptr + offs_n[:, None] * D + offs_d[None, :])
    m2, l2, acc2 = online_softmax_step(m, l, acc, s, v)
    tl.store(m_out + offs_r, m2)
    tl.store(l_out + offs_r, l2)
    tl.store(acc_out + offs_r[:, None] * D + offs_d[None, :], acc2)
