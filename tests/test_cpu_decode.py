"""The C attention kernel (cpu/attention.c) against the torch reference it must match.

It reads K/V in place through block tables, so the cases are the ones where
an address computation can go wrong: shuffled block tables, a sequence that
ends mid-block or exactly on a block's end, block size 1, a single token,
head dims that are and are not a multiple of 8 (the kernel's running
sums), every GQA ratio, long contexts, and a bf16 cache (float32 math); the library's store_kv writes what
the reference writes. Then the engine: the tokens with
the kernel on equal those with it off, and a build failure falls back to the
torch path with a warning instead of failing.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_engine, run_to_end, without_c_compiler

from nanoserve import SamplingParams
from nanoserve.cpu import attention as cpu_decode
from nanoserve.cpu.backend import CpuBackend
from nanoserve.kernels import reference
from nanoserve.kernels.torch_backend import TorchBackend

kernel_f32 = cpu_decode.load(torch.float32)
pytestmark = pytest.mark.skipif(kernel_f32 is None, reason="no C compiler to build the CPU decode kernel")


def paged_case(lens, bs, hq, hkv, d, dtype=torch.float32, seed=0):
    """Random caches, and block tables drawn from a shuffled pool (no two sequences share a block)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    need = sum(-(-n // bs) for n in lens)
    num_blocks = need + 5
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables) + 1                    # one padding column more than anyone needs
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens)


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (6, 1)])
@pytest.mark.parametrize("d", [64, 128, 80, 12, 8])
def test_kernel_matches_the_reference(bs, hq, hkv, d):
    lens = [1, bs, bs + 1, 3 * bs, 37, 100]                    # one token, a full block, one past it, ...
    q, k_cache, v_cache, tables, seq_lens = paged_case(lens, bs, hq, hkv, d)
    want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
    got = kernel_f32(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("d", [64, 128, 256, 40])
def test_both_vector_widths_match_the_reference(lanes, dtype, d):
    # The kernel groups query heads per pass by how many sums its vector registers hold: AVX-512 (16-float
    # vectors) and AVX2 (8) take different groupings; both builds run here, whatever this CPU has.
    kernel = cpu_decode.load(dtype, (f"-DVEC_LANES={lanes}",))
    for hq, hkv in [(9, 3), (8, 2), (7, 1), (2, 2)]:
        q, k_cache, v_cache, tables, seq_lens = paged_case([1, 7, 16, 33, 150], 16, hq, hkv, d, dtype=dtype)
        want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5, compute_dtype=torch.float32)
        got = kernel(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_long_context_and_many_sequences():
    lens = [4096, 1, 2000, 513] + [random.Random(i).randint(1, 700) for i in range(28)]
    q, k_cache, v_cache, tables, seq_lens = paged_case(lens, 16, 9, 3, 64)
    want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(kernel_f32(q, k_cache, v_cache, tables, seq_lens, 0.125), want, atol=1e-5, rtol=1e-5)


def test_bf16_cache_is_read_as_float32():
    kernel = cpu_decode.load(torch.bfloat16)
    q, k_cache, v_cache, tables, seq_lens = paged_case([5, 40, 17], 16, 9, 3, 64, dtype=torch.bfloat16)
    # The torch fast path's bf16 rule: bf16 K/V values, float32 math, output rounded to bf16.
    want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, compute_dtype=torch.float32)
    got = kernel(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)


def test_bad_arguments_are_refused_before_the_c_code_runs():
    q, k_cache, v_cache, tables, seq_lens = paged_case([5, 9], 4, 4, 2, 16)
    good = kernel_f32(q, k_cache, v_cache, tables, seq_lens, 0.25)
    # The same shapes as the good call just before (the wrapper checks shapes once per layout; the values
    # are checked on every call, in C), then other shapes.
    with pytest.raises(ValueError, match="^seq_lens: expected lengths from 1"):
        kernel_f32(q, k_cache, v_cache, tables, torch.tensor([5, 0]), 0.25)           # an empty sequence
    with pytest.raises(ValueError, match="^block_tables: expected block ids below"):
        kernel_f32(q, k_cache, v_cache, tables - 1000, seq_lens, 0.25)                # a negative block id
    with pytest.raises(ValueError, match="^seq_lens: expected lengths from 1"):
        kernel_f32(q, k_cache, v_cache, tables, torch.tensor([5, 99]), 0.25)          # longer than its table
    with pytest.raises(ValueError, match="^block_tables: expected block ids below"):
        kernel_f32(q, k_cache, v_cache, tables + 1000, seq_lens, 0.25)                # a block past the pool
    with pytest.raises(ValueError, match="^(q|k_cache): expected"):
        kernel_f32(q, k_cache.double(), v_cache.double(), tables, seq_lens, 0.25)     # not this build's dtype
    with pytest.raises(ValueError, match="^q: expected head_dim"):
        kernel_f32(q[..., :8], k_cache, v_cache, tables, seq_lens, 0.25)              # head_dim unlike the cache
    torch.testing.assert_close(kernel_f32(q, k_cache, v_cache, tables, seq_lens, 0.25), good, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_may_be_rows_of_a_wider_tensor(dtype):
    # What cpu/llama.py passes: q as the first Hq * D columns of the merged q/k/v matmul output, in the
    # model's dtype (the kernel reads bf16 rows as they lie: no copy, no conversion).
    kernel = cpu_decode.load(dtype)
    q, k_cache, v_cache, tables, seq_lens = paged_case([3, 40, 17, 64], 16, 9, 3, 64, dtype=dtype)
    qkv = torch.cat([q.flatten(1), torch.randn(4, 2 * 3 * 64).to(dtype)], dim=1)
    rows = qkv[:, : 9 * 64].view(4, 9, 64)
    assert not rows.is_contiguous()
    want = kernel(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(kernel(rows, k_cache, v_cache, tables, seq_lens, 0.125), want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_what_the_reference_writes(dtype):
    # k and v as cpu_llama.py passes them: columns of the merged q/k/v output, rows apart; slots scattered.
    store = cpu_decode.load_store(dtype)
    gen = torch.Generator().manual_seed(0)
    T, hq, hkv, d, bs, n = 37, 9, 3, 64, 16, 20
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=gen).to(dtype)
    k, v = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    slots = torch.randperm(n * bs, generator=gen)[:T]
    caches = [torch.randn(n, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.store_kv(k, v, *want, slots)
    store(k, v, *caches, slots)
    assert all(torch.equal(got, w) for got, w in zip(caches, want))


def test_store_refuses_a_slot_outside_the_pool_and_writes_nothing():
    store = cpu_decode.load_store(torch.float32)
    k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    k, v = torch.ones(3, 2, 8), torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match="^slot_mapping: expected slots below the pool's 8"):
        store(k, v, k_cache, v_cache, torch.tensor([0, 5, 8]))
    with pytest.raises(ValueError, match="^slot_mapping: expected slots below"):
        store(k, v, k_cache, v_cache, torch.tensor([-1, 5, 2]))
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match="^k: expected"):
        store(k.double(), v, k_cache, v_cache, torch.tensor([0, 1, 2]))     # not the cache's dtype
    with pytest.raises(ValueError, match="^slot_mapping: expected"):
        store(k, v, k_cache, v_cache, torch.tensor([0, 1]))                 # one slot short


def test_engine_tokens_equal_with_the_kernel_on_and_off(tiny_llama):
    on = make_engine(tiny_llama, block_size=4, num_blocks=64)
    off = make_engine(tiny_llama, block_size=4, num_blocks=64, path="torch")
    assert isinstance(on.runner.attn, CpuBackend) and on.implementation.attention.startswith("cpu")
    assert isinstance(off.runner.attn, TorchBackend) and off.implementation.attention.startswith("torch")
    prompts = [[5, 9, 200, 31, 7, 7, 100], [3, 1, 4, 1, 5], [42], list(range(30, 53))]
    for engine in (on, off):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got, want = run_to_end(on), run_to_end(off)
    assert {k: o.outputs[0].token_ids for k, o in got.items()} == {k: o.outputs[0].token_ids for k, o in want.items()}


def test_a_failed_build_falls_back_to_torch(tiny_llama, monkeypatch):
    with without_c_compiler(monkeypatch, cpu_decode.library, cpu_decode.load, cpu_decode.load_store):
        with pytest.warns(UserWarning, match="torch path"):
            engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
        assert isinstance(engine.runner.attn, TorchBackend) and engine.runner.attn.grouped
        # ... and says so: what ran, and why not the C kernel
        assert engine.implementation.attention.startswith("torch")
        assert "attention.c not built: no C compiler found" in engine.implementation.note
        assert "attention.c not built" in engine.snapshot()["implementation"]["note"]
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        assert len(run_to_end(engine)["r"].outputs[0].token_ids) == 3
