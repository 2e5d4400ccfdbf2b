"""The triton-decode lab's probe kernel: fold a few tiles with `online_softmax_step`, nothing else.

One program folds TILES tiles of scores s [R, N] and values v [N, D] into the
running (m, l, acc) and stores acc / l, so a student's step is checked on
hand-made tiles (a fully masked one first, say) before it runs inside the
decode and prefill kernels. triton_lab.py loads this file with the student's
step in place of triton_common's, like it loads those kernels. It lives in a
file of its own (not a string) because Triton compiles a kernel for a GPU
from its source file.
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
