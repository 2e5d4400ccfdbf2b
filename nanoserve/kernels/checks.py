"""Argument checks shared by the kernel wrappers: fail with the argument's name before any launch.

A kernel launched on a tensor of the wrong shape, dtype or device reads the
wrong memory or crashes far from the cause. Every Triton wrapper calls these
first, so the error names the argument and what was expected.
"""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def expect(cond: bool, name: str, what: str, tensor: torch.Tensor) -> None:
    if not cond:
        raise ValueError(f"{name}: expected {what}, got shape {tuple(tensor.shape)} dtype {tensor.dtype} "
                         f"on {tensor.device}")


def layout(*tensors: torch.Tensor | None) -> tuple:
    """All the checks here look at: each tensor's shape, strides, dtype and device (None stays None)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


class CheckedLayouts:
    """Run a wrapper's checks only when its arguments' layout changes.

    A wrapper called in every layer of a step sees the same layout 30 times: arguments whose layout
    equals the last one that passed would pass the same checks, so they are skipped (a check costs
    more than the C call it guards at a decode step's sizes)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple] = {}    # wrapper name -> the last layout that passed its checks

    def check(self, name: str, check, *tensors: torch.Tensor | None) -> None:
        """check(*tensors) (raising ValueError) unless these tensors' layout passed it last time."""
        key = layout(*tensors)
        if self._last.get(name) != key:
            check(*tensors)
            self._last[name] = key


def check_cache(name: str, cache: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """A KV cache: [num_blocks, block_size, num_kv_heads, head_dim], float, contiguous last dim."""
    expect(cache.dim() == 4, name, "a 4-d cache [num_blocks, block_size, num_kv_heads, head_dim]", cache)
    expect(cache.dtype in FLOATS, name, "a float16/bfloat16/float32 tensor", cache)
    expect(cache.stride(-1) == 1, name, "a contiguous last dimension", cache)
    if like is not None:
        expect(cache.shape == like.shape and cache.dtype == like.dtype and cache.device == like.device,
                name, f"the same shape, dtype and device as the K cache {tuple(like.shape)}", cache)


def check_paged_args(*, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor | None = None) -> None:
    """Queries [T, Hq, D] against a paged cache, with block tables [rows, max_blocks]."""
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache, like=k_cache)
    expect(q.dim() == 3, "q", "a 3-d tensor [tokens, num_heads, head_dim]", q)
    expect(q.dtype == k_cache.dtype, "q", f"dtype {k_cache.dtype} like the cache", q)
    expect(q.device == k_cache.device, "q", f"device {k_cache.device} like the cache", q)
    expect(q.shape[2] == k_cache.shape[3], "q", f"head_dim {k_cache.shape[3]} like the cache", q)
    expect(q.shape[1] % k_cache.shape[2] == 0, "q",
            f"a head count divisible by the cache's {k_cache.shape[2]} KV heads", q)
    expect(q.stride(-1) == 1, "q", "a contiguous last dimension", q)
    expect(block_tables.dim() == 2 and block_tables.dtype in INTS, "block_tables",
            "a 2-d int32/int64 tensor [rows, max_blocks]", block_tables)
    expect(block_tables.device == q.device, "block_tables", f"device {q.device}", block_tables)
    if seq_lens is not None:
        expect(seq_lens.dim() == 1 and seq_lens.dtype in INTS and seq_lens.device == q.device, "seq_lens",
                f"a 1-d int32/int64 tensor on {q.device}", seq_lens)


def check_int_vector(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    expect(t.dim() == 1 and t.shape[0] == n and t.dtype in INTS and t.device == device, name,
            f"a 1-d int32/int64 tensor of length {n} on {device}", t)
