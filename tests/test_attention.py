"""Reference paged attention against a naive contiguous implementation.

The naive version never sees a block table: each sequence's K/V is one
contiguous tensor, attention is softmax(Q K^T * scale + causal mask) V, and
grouped-query attention repeats each KV head `Hq // Hkv` times with
`repeat_interleave` (query head h reads KV head h // group). The paged
versions must match it for any block size and any physical placement of the
blocks, including shuffled tables, padding and stale slots.

Whole mixed batches go through the torch backend's `prepare` + `forward`,
with its plain path and its fast path (decodes in groups), which must agree.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.attention import BatchLayout, PrefillChunk, paged_attention
from nanoserve.cpu import attention as cpu_attention
from nanoserve.cpu.backend import CpuBackend
from nanoserve.kernels.reference import (
    decode_attention,
    decode_mask,
    gather_kv,
    prefill_attention,
    prefill_mask,
    store_kv,
)
from nanoserve.kernels.torch_backend import TorchBackend

HEAD_DIM = 8
ATOL = 1e-5


def naive_attention(q, k, v, scale, window=None):
    """q [Tq, Hq, D] at positions [L - Tq, L); k, v [L, Hkv, D] contiguous -> [Tq, Hq, D].
    `window`: each query sees only the keys less than `window` positions behind it."""
    tq, hq, _ = q.shape
    L, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)                  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale    # [Hq, Tq, L]
    q_pos = torch.arange(L - tq, L)[:, None]
    k_pos = torch.arange(L)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(k_pos <= q_pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedCache:
    """A K/V cache full of garbage whose blocks are handed out in a random order."""

    def __init__(self, num_blocks, block_size, num_kv_heads, gen):
        shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
        # Garbage (large, so a masking mistake shows) in every slot nobody wrote.
        self.k = torch.randn(shape, generator=gen) * 10
        self.v = torch.randn(shape, generator=gen) * 10
        self.bs = block_size
        self.order = torch.randperm(num_blocks, generator=gen).tolist()   # shuffled physical ids

    def table(self, num_tokens):
        n = -(-num_tokens // self.bs)
        assert n <= len(self.order), "test pool too small"
        ids, self.order = self.order[:n], self.order[n:]
        return ids

    def slots(self, table, start, stop):
        return torch.tensor([table[p // self.bs] * self.bs + p % self.bs for p in range(start, stop)],
                            dtype=torch.int64)

    def write(self, table, k, v, start=0):
        """Store tokens [start, start + len(k)) of a sequence through store_kv."""
        store_kv(k, v, self.k, self.v, self.slots(table, start, start + k.shape[0]))


def rand(gen, *shape):
    return torch.randn(shape, generator=gen)


GEOMETRIES = [
    # (num_q_heads, num_kv_heads): MHA and GQA with group 3
    (2, 2),
    (6, 2),
]


# -- store_kv ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_store_kv_then_gather_roundtrips(block_size):
    gen = torch.Generator().manual_seed(block_size)
    cache = PagedCache(40, block_size, 2, gen)
    lens = [1, 7, 2 * block_size + 3]
    seqs = []
    for L in lens:
        table = cache.table(L)
        k, v = rand(gen, L, 2, HEAD_DIM), rand(gen, L, 2, HEAD_DIM)
        cache.write(table, k, v)
        seqs.append((table, k, v))
    # Writes only touch their own slots: every sequence reads back exactly its tokens.
    for table, k, v in seqs:
        L = k.shape[0]
        t = torch.tensor(table)[None]
        assert torch.equal(gather_kv(cache.k, t)[0, :L], k)
        assert torch.equal(gather_kv(cache.v, t)[0, :L], v)


def test_store_kv_token_lands_at_documented_slot():
    gen = torch.Generator().manual_seed(0)
    cache = PagedCache(6, 4, 1, gen)
    table = [5, 2, 0]
    k, v = rand(gen, 10, 1, HEAD_DIM), rand(gen, 10, 1, HEAD_DIM)
    cache.write(table, k, v)
    for i in range(10):
        assert torch.equal(cache.k[table[i // 4], i % 4], k[i])
        assert torch.equal(cache.v[table[i // 4], i % 4], v[i])


# -- decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", GEOMETRIES)
def test_decode_matches_naive(block_size, hq, hkv):
    gen = torch.Generator().manual_seed(100 * block_size + hq)
    lens = [1, 3, 5, 17, 2 * block_size + 1, 33]
    cache = PagedCache(sum(-(-L // block_size) for L in lens) + 3, block_size, hkv, gen)
    scale = 1 / math.sqrt(HEAD_DIM)
    tables, ks, vs = [], [], []
    for L in lens:
        table = cache.table(L)
        k, v = rand(gen, L, hkv, HEAD_DIM), rand(gen, L, hkv, HEAD_DIM)
        cache.write(table, k, v)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    # Pad the tables with a *valid* block full of someone else's data: the mask must hide it.
    width = max(len(t) for t in tables)
    pad = tables[-1][0]
    block_tables = torch.tensor([t + [pad] * (width - len(t)) for t in tables])
    q = rand(gen, len(lens), hq, HEAD_DIM)
    seq_lens = torch.tensor(lens)
    out = decode_attention(q, cache.k, cache.v, block_tables, seq_lens, scale)
    assert out.shape == (len(lens), hq, HEAD_DIM)
    # The same with the mask built ahead, as the runner does once per step.
    mask = decode_mask(seq_lens, width * block_size)
    assert torch.equal(decode_attention(q, cache.k, cache.v, block_tables, seq_lens, scale, mask), out)
    for b, L in enumerate(lens):
        expected = naive_attention(q[b : b + 1], ks[b], vs[b], scale)[0]
        torch.testing.assert_close(out[b], expected, atol=ATOL, rtol=0)


def test_decode_single_token_sequence_returns_its_value():
    """Length 1: softmax over one key is 1, so the output is that token's V (per GQA group)."""
    gen = torch.Generator().manual_seed(7)
    cache = PagedCache(5, 4, 2, gen)
    table = cache.table(1)
    k, v = rand(gen, 1, 2, HEAD_DIM), rand(gen, 1, 2, HEAD_DIM)
    cache.write(table, k, v)
    q = rand(gen, 1, 6, HEAD_DIM)
    out = decode_attention(q, cache.k, cache.v, torch.tensor([table]), torch.tensor([1]), 0.5)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(3, dim=0), atol=ATOL, rtol=0)


# -- masks -----------------------------------------------------------------------------------


def test_decode_mask_marks_the_first_seq_len_slots():
    mask = decode_mask(torch.tensor([1, 4, 6]), 8)
    assert mask.shape == (3, 1, 1, 8) and mask.dtype == torch.bool
    expected = torch.tensor([[j < L for j in range(8)] for L in (1, 4, 6)])
    assert torch.equal(mask[:, 0, 0], expected)


@pytest.mark.parametrize("num_q,ctx", [(1, 1), (1, 9), (4, 4), (3, 10)])
def test_prefill_mask_is_causal_after_the_prefix(num_q, ctx):
    mask = prefill_mask(num_q, ctx, "cpu")
    assert mask.shape == (num_q, ctx)
    for i in range(num_q):
        pos = ctx - num_q + i
        assert mask[i].tolist() == [j <= pos for j in range(ctx)]


# -- prefill -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", GEOMETRIES)
@pytest.mark.parametrize("prefix,chunk", [(0, 1), (0, 7), (0, 37), (5, 6), (6, 1), (3, 30), (17, 5)])
def test_prefill_matches_naive(block_size, hq, hkv, prefix, chunk):
    """A chunk of `chunk` queries after `prefix` cached tokens (mid-block whenever prefix % bs != 0)."""
    gen = torch.Generator().manual_seed(block_size * 1000 + prefix * 50 + chunk + hq)
    ctx = prefix + chunk
    cache = PagedCache(-(-ctx // block_size) + 4, block_size, hkv, gen)
    table = cache.table(ctx)
    k, v = rand(gen, ctx, hkv, HEAD_DIM), rand(gen, ctx, hkv, HEAD_DIM)
    cache.write(table, k[:prefix], v[:prefix])              # an earlier step cached the prefix
    cache.write(table, k[prefix:], v[prefix:], start=prefix)  # this step stores its chunk first
    q = rand(gen, chunk, hq, HEAD_DIM)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = prefill_attention(q, cache.k, cache.v, torch.tensor(table), ctx, scale)
    torch.testing.assert_close(out, naive_attention(q, k, v, scale), atol=ATOL, rtol=0)
    mask = prefill_mask(chunk, ctx, q.device)
    assert torch.equal(prefill_attention(q, cache.k, cache.v, torch.tensor(table), ctx, scale, mask), out)


def test_prefill_ignores_blocks_past_context():
    """A block table longer than the context (e.g. reserved ahead) must not change the result."""
    gen = torch.Generator().manual_seed(3)
    cache = PagedCache(12, 4, 2, gen)
    table = cache.table(9 + 8)          # room for 17 tokens, only 9 written
    k, v = rand(gen, 9, 2, HEAD_DIM), rand(gen, 9, 2, HEAD_DIM)
    cache.write(table, k, v)
    q = rand(gen, 4, 6, HEAD_DIM)
    out = prefill_attention(q, cache.k, cache.v, torch.tensor(table), 9, 0.3)
    torch.testing.assert_close(out, naive_attention(q, k, v, 0.3), atol=ATOL, rtol=0)


# -- paged_attention on a mixed batch --------------------------------------------------------


def run_mixed_batch(block_size, hq, hkv, decode_lens, prefill_specs, seed, window=None, extra_backends=()):
    """Build a runner-shaped batch (decodes first, then prefill chunks) and check every row.

    decode_lens: context length of each decoding sequence (the new token included).
    prefill_specs: (cached prefix, chunk length) of each prefilling sequence.
    """
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = list(decode_lens) + [p + c for p, c in prefill_specs]
    need = sum(-(-L // block_size) for L in ctx_lens)
    cache = PagedCache(need + 2, block_size, hkv, gen)
    scale = 1 / math.sqrt(HEAD_DIM)

    seqs = []   # (table, full k, full v, first new position, context length)
    for L in decode_lens:
        seqs.append((cache.table(L), L - 1, L))
    for p, c in prefill_specs:
        seqs.append((cache.table(p + c), p, p + c))
    full = []
    for table, start, L in seqs:
        k, v = rand(gen, L, hkv, HEAD_DIM), rand(gen, L, hkv, HEAD_DIM)
        cache.write(table, k[:start], v[:start])   # KV computed by earlier steps
        full.append((k, v))

    # This step's flat token row.
    q_rows, k_rows, v_rows, slots, prefills = [], [], [], [], []
    row = 0
    for i, (table, start, L) in enumerate(seqs):
        n = L - start
        k, v = full[i]
        q_rows.append(rand(gen, n, hq, HEAD_DIM))
        k_rows.append(k[start:])
        v_rows.append(v[start:])
        slots.append(cache.slots(table, start, L))
        if i >= len(decode_lens):
            prefills.append(PrefillChunk(row, n, L, table))
        row += n
    layout = BatchLayout(block_size, torch.cat(slots), list(decode_lens),
                         [seqs[i][0] for i in range(len(decode_lens))], prefills)
    q, k, v = torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows)
    backends = [TorchBackend(grouped=False), TorchBackend(grouped=True, group_size=2), *extra_backends]
    if cpu_attention.load(torch.float32) is not None:    # the CPU backend: store and every row in C
        backends.append(CpuBackend(cpu_attention.load(torch.float32), cpu_attention.load_store(torch.float32)))
    outs, caches = [], []
    for backend in backends:          # each path writes this step's K/V into its own copy of the cache
        caches.append((cache.k.clone(), cache.v.clone()))
        outs.append(paged_attention(q, k, v, *caches[-1], backend.prepare(layout), scale, window=window))
    for other, (k_other, v_other) in zip(outs[1:], caches[1:]):
        torch.testing.assert_close(other, outs[0], atol=ATOL, rtol=0)   # plain, fast and C paths agree
        assert torch.equal(k_other, caches[0][0]) and torch.equal(v_other, caches[0][1])   # and store alike
    out, (cache.k, cache.v) = outs[0], caches[0]
    assert out.shape == q.shape

    row = 0
    for i, (table, start, L) in enumerate(seqs):
        n = L - start
        kf, vf = full[i]
        expected = naive_attention(q_rows[i], kf, vf, scale, window)
        torch.testing.assert_close(out[row : row + n], expected, atol=ATOL, rtol=0)
        # The whole sequence is now readable through its table.
        t = torch.tensor(table)[None]
        assert torch.equal(gather_kv(cache.k, t)[0, :L], kf)
        assert torch.equal(gather_kv(cache.v, t)[0, :L], vf)
        row += n


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 4])
def test_paged_attention_sliding_window(block_size, window):
    """A sliding-window layer (Gemma 3's local layers): every backend with window masks (torch plain and
    grouped, the C kernel, the Triton kernels where triton is installed: under its interpreter on a CPU)
    attends each query to its last `window` keys only, decodes and chunks alike, windows that start
    mid-block and chunks longer than the window included."""
    extra = []
    if importlib.util.find_spec("triton") is not None:
        from nanoserve.kernels.triton_backend import TritonBackend
        extra.append(TritonBackend())
    run_mixed_batch(block_size, 4, 2, decode_lens=[1, 2, 7, 20, 70], prefill_specs=[(0, 9), (5, 3), (11, 40)],
                    seed=window * 7 + block_size, window=window, extra_backends=extra)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", GEOMETRIES)
def test_paged_attention_mixed_batch(block_size, hq, hkv):
    run_mixed_batch(
        block_size, hq, hkv,
        decode_lens=[1, 6, 19, 2 * block_size + 1],
        prefill_specs=[(0, 9), (5, 3), (block_size + 1, 11), (0, 1 if block_size > 1 else 2)],
        seed=block_size * 10 + hq,
    )


@pytest.mark.parametrize("hq,hkv", GEOMETRIES)
def test_paged_attention_only_decodes_and_only_prefills(hq, hkv):
    run_mixed_batch(4, hq, hkv, decode_lens=[3, 9], prefill_specs=[], seed=1)
    run_mixed_batch(4, hq, hkv, decode_lens=[], prefill_specs=[(0, 5), (7, 2)], seed=2)


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16]),
    geometry=st.sampled_from(GEOMETRIES),
    decode_lens=st.lists(st.integers(1, 40), max_size=4),
    prefill_specs=st.lists(st.tuples(st.integers(0, 30), st.integers(2, 20)), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_random_batches(block_size, geometry, decode_lens, prefill_specs, seed):
    if not decode_lens and not prefill_specs:
        decode_lens = [1]
    run_mixed_batch(block_size, *geometry, decode_lens, prefill_specs, seed)


def test_fast_path_multiplies_a_bf16_cache_in_float32():
    """compute_dtype=float32 (a bf16 cache on a CPU without bf16 units) matches the naive float32 attention
    of the same bf16 values more closely than bf16 arithmetic can, and the plain bf16 path within bf16 error."""
    gen = torch.Generator().manual_seed(7)
    bs, hq, hkv = 4, 4, 2
    cache = PagedCache(16, bs, hkv, gen)
    cache.k, cache.v = cache.k.bfloat16(), cache.v.bfloat16()
    lens = [9, 3]
    tables = [cache.table(L) for L in lens]
    full = [(rand(gen, L, hkv, HEAD_DIM).bfloat16(), rand(gen, L, hkv, HEAD_DIM).bfloat16()) for L in lens]
    for t, (k, v) in zip(tables, full):
        cache.write(t, k[:-1], v[:-1])
    q = rand(gen, 2, hq, HEAD_DIM).bfloat16()
    k_new = torch.stack([k[-1] for k, _ in full])
    v_new = torch.stack([v[-1] for _, v in full])
    slots = torch.cat([cache.slots(t, L - 1, L) for t, L in zip(tables, lens)])
    layout = BatchLayout(bs, slots, lens, tables)
    fast = TorchBackend(grouped=True, compute_dtype=torch.float32)
    got = paged_attention(q, k_new, v_new, cache.k, cache.v, fast.prepare(layout), 0.3)
    plain = TorchBackend(grouped=False)
    got_plain = paged_attention(q, k_new, v_new, cache.k, cache.v, plain.prepare(layout), 0.3)
    for i, (k, v) in enumerate(full):
        want = naive_attention(q[i : i + 1].float(), k.float(), v.float(), 0.3)[0]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got[i].float(), want, atol=1e-2, rtol=0)        # bf16 output rounding only
        torch.testing.assert_close(got_plain[i].float(), want, atol=5e-2, rtol=0)
