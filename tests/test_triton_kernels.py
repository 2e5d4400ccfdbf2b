"""Triton kernels against the torch reference, on CPU under TRITON_INTERPRET=1 (set in conftest).

(benchmarks/gpu_check.py runs this file on a GPU: NANOSERVE_TEST_DEVICE=cuda puts every tensor there.)

Small shapes: the interpreter runs each program in Python. Every case the
issue lists: odd sequence lengths, block sizes 1 and 16, GQA ratios 1 and 3,
shuffled block tables, length-1 sequences, a prefill chunk that starts
mid-block after a cached prefix, split-K decode; plus the engine end to end
and argument checks that fail before launch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

triton = pytest.importorskip("triton")

from nanoserve.kernels import reference  # noqa: E402
from nanoserve.kernels.triton_cache import copy_blocks, store_kv  # noqa: E402
from nanoserve.kernels.triton_decode import decode_attention  # noqa: E402
from nanoserve.kernels.triton_prefill import prefill_attention  # noqa: E402

D = 16
NUM_BLOCKS = 80


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE)


def caches(bs: int, hkv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_BLOCKS, bs, hkv, D, generator=g).to(DEVICE),
            torch.randn(NUM_BLOCKS, bs, hkv, D, generator=g).to(DEVICE))


def shuffled_tables(lens: list[int], bs: int, seed: int = 0) -> torch.Tensor:
    """Disjoint random (non-contiguous) blocks per sequence, padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables, i = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[i : i + nb] + [0] * (width - nb))
        i += nb
    return torch.tensor(tables, device=DEVICE)


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (3, 1), (6, 2)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(bs, hq, hkv, splits):
    lens = [1, 7, 33] if bs == 16 else [1, 7, 13]       # odd lengths, a length-1 sequence
    kc, vc = caches(bs, hkv)
    bt = shuffled_tables(lens, bs)
    q = torch.randn(len(lens), hq, D, device=DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    want = reference.decode_attention(q, kc, vc, bt, seq_lens, 0.3)
    got = decode_attention(q, kc, vc, bt, seq_lens, 0.3, num_splits=splits, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 40])
def test_windowed_decode_and_prefill_match_reference(window):
    """A sliding window (Gemma 3's local layers): splits wholly before the window are empty, tiles that
    start before it are masked; the same numbers as the torch reference under the windowed masks."""
    from nanoserve.kernels.torch_backend import decode_window, prefill_window

    lens = [1, 7, 70, 200]
    kc, vc = caches(4, 2)
    bt = shuffled_tables(lens, 4)
    q = torch.randn(len(lens), 4, D, device=DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    mask = decode_window(reference.decode_mask(seq_lens, bt.shape[1] * 4), seq_lens, window)
    want = reference.decode_attention(q, kc, vc, bt, seq_lens, 0.3, mask)
    got = decode_attention(q, kc, vc, bt, seq_lens, 0.3, num_splits=3, block_n=16, window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    chunks = [(0, 20), (33, 9)]                           # (cached prefix, chunk length)
    contexts, qlens = [p + n for p, n in chunks], [n for _, n in chunks]
    tables = shuffled_tables(contexts, 4, seed=3)
    qp = torch.randn(sum(qlens), 4, D, device=DEVICE)
    got = prefill_attention(qp, kc, vc, tables, torch.tensor([0, qlens[0]], device=DEVICE),
                            torch.tensor(qlens, device=DEVICE), torch.tensor(contexts, device=DEVICE), 0.3,
                            block_m=16, block_n=16, window=window)
    for s, n, ctx, table in zip([0, qlens[0]], qlens, contexts, tables):
        want = reference.prefill_attention(qp[s : s + n], kc, vc, table, ctx, 0.3,
                                           prefill_window(reference.prefill_mask(n, ctx, DEVICE), window))
        torch.testing.assert_close(got[s : s + n], want, atol=1e-5, rtol=1e-5)


def test_decode_bits_do_not_depend_on_the_table_width():
    """A CUDA graph's batch pads every block table to max_model_len (cuda_graphs.py); the splits are a
    fixed 256 positions, so a sequence's output has the same bits however wide its table is padded."""
    lens = [300, 40, 1]
    kc, vc = caches(16, 2)
    bt = shuffled_tables(lens, 16)                                    # 19 blocks wide
    q = torch.randn(len(lens), 4, D, device=DEVICE)
    narrow = decode_attention(q, kc, vc, bt, torch.tensor(lens, device=DEVICE), 0.3)
    wide = torch.cat([bt, torch.zeros(len(lens), 45, dtype=bt.dtype, device=DEVICE)], dim=1)    # 64 blocks: 4 splits, not 2
    assert torch.equal(decode_attention(q, kc, vc, wide, torch.tensor(lens, device=DEVICE), 0.3), narrow)


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (3, 1)])
def test_prefill_matches_reference(bs, hq, hkv):
    # Three chunks: a fresh prompt, a chunk starting mid-block after a cached prefix, a 1-token chunk.
    chunks = [(0, 5), (19, 9), (30, 1)]                   # (cached prefix, chunk length)
    contexts = [p + n for p, n in chunks]
    kc, vc = caches(bs, hkv, seed=1)
    bt = shuffled_tables(contexts, bs, seed=2)
    lens = [n for _, n in chunks]
    q = torch.randn(sum(lens), hq, D, device=DEVICE)
    starts = torch.tensor([0, lens[0], lens[0] + lens[1]], device=DEVICE)
    got = prefill_attention(q, kc, vc, bt, starts, torch.tensor(lens, device=DEVICE),
                            torch.tensor(contexts, device=DEVICE), 0.3, block_m=16, block_n=16)
    for (s, n, ctx, table) in zip(starts.tolist(), lens, contexts, bt):
        want = reference.prefill_attention(q[s : s + n], kc, vc, table, ctx, 0.3)
        torch.testing.assert_close(got[s : s + n], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [1, 16])
def test_store_kv_matches_reference(bs):
    kc, vc = caches(bs, 3)
    k, v = torch.randn(5, 3, D, device=DEVICE), torch.randn(5, 3, D, device=DEVICE)
    slots = torch.tensor([0, 7, bs * 5 + 1, bs * 9, NUM_BLOCKS * bs - 1], device=DEVICE) % (NUM_BLOCKS * bs)
    want_k, want_v = kc.clone(), vc.clone()
    reference.store_kv(k, v, want_k, want_v, slots)
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_copy_blocks():
    kc, vc = caches(4, 2)
    before = kc.clone()
    copy_blocks([kc, vc], tensor([3, 10]), tensor([20, 5]), chunk=64)
    assert torch.equal(kc[20], before[3]) and torch.equal(kc[5], before[10]) and torch.equal(vc[20], vc[3])
    untouched = [i for i in range(NUM_BLOCKS) if i not in (20, 5)]
    assert torch.equal(kc[untouched], before[untouched])


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_engine_with_triton_matches_torch(kind, tiny_llama, tiny_gpt2):
    from conftest import make_engine

    from nanoserve import SamplingParams

    loaded = tiny_llama if kind == "llama" else tiny_gpt2
    prompts = [[1, 2, 3], list(range(5, 24)), [9] * 7, [42]]
    outs = []
    for backend in ("torch", "triton"):
        # A small budget and pool: chunked prefill and preemption happen with both backends.
        engine = make_engine(loaded, attention_backend=backend, block_size=4, num_blocks=10,
                             max_num_batched_tokens=12)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        done, preempted = {}, 0
        while engine.has_unfinished_requests():
            result = engine.step()
            preempted += result.stats.num_preempted
            done.update({o.request_id: o.outputs[0].token_ids for o in result.outputs if o.finished})
        outs.append((done, preempted))
    assert outs[0][0] == outs[1][0]
    assert outs[1][1] > 0, "the pool was meant to force preemption"


# -- bad arguments fail before launch, naming the argument --------------------------------------


def test_wrong_arguments_name_the_argument():
    kc, vc = caches(4, 2)
    bt, lens = shuffled_tables([5], 4), torch.tensor([5], device=DEVICE)
    q = torch.randn(1, 4, D, device=DEVICE)
    with pytest.raises(ValueError, match="^q:.*head_dim"):
        decode_attention(torch.randn(1, 4, D + 1, device=DEVICE), kc, vc, bt, lens, 0.3)
    with pytest.raises(ValueError, match="^q:.*dtype"):
        decode_attention(q.double(), kc, vc, bt, lens, 0.3)
    with pytest.raises(ValueError, match="^v_cache"):
        decode_attention(q, kc, vc[:, :2], bt, lens, 0.3)
    with pytest.raises(ValueError, match="^block_tables"):
        decode_attention(q, kc, vc, bt.float(), lens, 0.3)
    with pytest.raises(ValueError, match="^q:.*divisible"):
        decode_attention(torch.randn(1, 3, D, device=DEVICE), kc, vc, bt, lens, 0.3)
    with pytest.raises(ValueError, match="^query_len"):
        prefill_attention(q, kc, vc, bt, tensor([0]), tensor([1, 2]), tensor([5]), 0.3)
    with pytest.raises(ValueError, match="^slot_mapping"):
        store_kv(torch.randn(2, 2, D, device=DEVICE), torch.randn(2, 2, D, device=DEVICE), kc, vc,
                 tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="^k:"):
        store_kv(torch.randn(2, 3, D, device=DEVICE), torch.randn(2, 2, D, device=DEVICE), kc, vc, tensor([1, 2]))
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks([kc], tensor([1, 2]), tensor([3, 3]))
