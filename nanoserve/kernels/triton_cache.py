"""Triton kernels that move K/V: store new tokens at their slots, copy whole blocks.

store_kv (grid = tokens):

    t = program id;  slot = slot_mapping[t]
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_cache[block, offset] = k[t];  v_cache[block, offset] = v[t]      all heads, all of head_dim

copy_blocks (grid = block pairs x chunks of one block), for copy-on-write and swap:

    i, chunk = program ids
    cache[dst[i]].flat[chunk] = cache[src[i]].flat[chunk]

A block of a contiguous cache is BLOCK_SIZE * Hkv * D consecutive elements,
so a block copy is a flat copy of that many elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.checks import check_cache, check_int_vector, expect


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,                 # [T, Hkv, D] new keys and values
    k_cache_ptr, v_cache_ptr,     # [N, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,             # [T] int
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cn, stride_ct, stride_ch,   # cache strides (K and V caches share their layout)
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]   # padding to powers of two
    dst = block * stride_cn + offset * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t] (and v); same contract as `reference.store_kv`."""
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache, like=k_cache)
    T = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        expect(t.dim() == 3 and t.shape[1:] == k_cache.shape[2:], name,
                f"[tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] like the cache's heads", t)
        expect(t.shape[0] == T and t.dtype == k_cache.dtype and t.device == k_cache.device, name,
                f"{T} tokens of dtype {k_cache.dtype} on {k_cache.device}", t)
        expect(t.stride(-1) == 1, name, "a contiguous last dimension", t)
    check_int_vector("slot_mapping", slot_mapping, T, k_cache.device)
    if T == 0:
        return
    H, D = k_cache.shape[2], k_cache.shape[3]
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=H, HEADS_PAD=triton.next_power_of_2(H), HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=k_cache.shape[1],
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,            # [N, ...] contiguous: a block is `block_numel` consecutive elements
    src_ptr, dst_ptr,     # [P] int block ids
    block_numel,
    CHUNK: tl.constexpr,  # elements per program
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel          # the last chunk of a block may be partial
    values = tl.load(cache_ptr + src * block_numel + offs, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offs, values, mask=mask)


def copy_blocks(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, chunk: int = 1024) -> None:
    """For every cache tensor (each layer's K and V): block dst[i] = block src[i]."""
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must pair up: {tuple(src.shape)} vs {tuple(dst.shape)}")
    for i, cache in enumerate(caches):
        check_cache(f"caches[{i}]", cache)
        expect(cache.is_contiguous(), f"caches[{i}]", "a contiguous tensor", cache)
        expect(cache.device == caches[0].device, f"caches[{i}]", f"device {caches[0].device}", cache)
    if caches:
        check_int_vector("src", src, src.shape[0], caches[0].device)
        check_int_vector("dst", dst, dst.shape[0], caches[0].device)
    if src.numel() == 0:
        return
    if len(set(dst.tolist())) != dst.numel() or set(dst.tolist()) & set(src.tolist()):
        raise ValueError("dst blocks must be distinct and not also sources (the copies would race)")
    for cache in caches:
        numel = cache[0].numel()
        _copy_blocks_kernel[(src.numel(), triton.cdiv(numel, chunk))](cache, src, dst, numel, CHUNK=chunk)
