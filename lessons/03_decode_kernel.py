"""Lesson 3: the paged decode attention kernel, one program at a time.

Run it:  python lessons/03_decode_kernel.py

The Triton kernel in `nanoserve/kernels/triton_decode.py` is what a GPU runs
for every decode step. Here it runs on the CPU under Triton's interpreter
(slow, but every line of the kernel really executes), on shapes small
enough to print. Each claim is checked with an `assert`.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # must be set before triton is imported

from nanoserve.lesson import breaks, console, section  # noqa: E402  prose that fits your terminal; --break NAME

BROKEN = breaks({
    "wrong-kv-head": "query heads 3..5 read KV head 0 (the grouped-query mapping is h // 3)",
    "average-splits": "combine the split-K partial results with equal weights instead of their lse",
})

import torch  # noqa: E402

from nanoserve.kernels import reference  # noqa: E402
from nanoserve.kernels.triton_decode import _paged_decode_kernel, decode_attention  # noqa: E402

torch.manual_seed(0)


# A tiny paged cache: 12 blocks of 4 token slots, 2 KV heads of dimension 8.
NUM_BLOCKS, BS, HKV, D = 12, 4, 2, 8
HQ = 6                                   # 6 query heads: 3 per KV head (GQA ratio 3)
k_cache = torch.randn(NUM_BLOCKS, BS, HKV, D)
v_cache = torch.randn(NUM_BLOCKS, BS, HKV, D)
# Two sequences of 10 and 3 tokens, their blocks scattered over the pool.
block_tables = torch.tensor([[7, 2, 9], [4, 0, 0]])   # sequence 1 needs one block; the rest is padding
seq_lens = torch.tensor([10, 3])
q = torch.randn(2, HQ, D)                # the newest token of each sequence
scale = D**-0.5

# ---------------------------------------------------------------------------
section("1. What one program computes", f"""
The grid is (sequences, KV heads, splits) = (2, {HKV}, 1): one program per sequence and KV head.
Program (b=0, kv_head=1) takes the 3 query heads {3}..{5} that share KV head 1, walks positions
0..{int(seq_lens[0]) - 1} of sequence 0 in tiles, and keeps a running max m, a running sum l and an
unnormalised output acc: the online softmax, so it never holds all the scores at once.
""")
out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1, block_n=4)
want = reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
assert torch.allclose(out, want, atol=1e-5)
console.print(f"kernel output for sequence 0, heads 3..5, first 4 dims:\n{out[0, 3:6, :4]}")
console.print("matches the torch reference (gather + softmax) to 1e-5.")

# ---------------------------------------------------------------------------
section("2. How the block table turns into addresses", """
For position n of sequence b the kernel loads block = block_table[b, n // 4] and reads slot
block * 4 + n % 4 of the cache. Here is that arithmetic for sequence 0, done by hand:
""")
positions = torch.arange(int(seq_lens[0]))
blocks = block_tables[0, positions // BS]
slots = blocks * BS + positions % BS
for n, b, s in zip(positions.tolist(), blocks.tolist(), slots.tolist()):
    console.print(f"  position {n:2d} -> block_table[0, {n // BS}] = {b} -> slot {s:2d}")
# The kernel computes exactly this: attention over the K/V rows at those slots.
k_seq = k_cache.view(-1, HKV, D)[slots]             # [10, Hkv, D] gathered by slot
v_seq = v_cache.view(-1, HKV, D)[slots]
kv_head = 0 if BROKEN == "wrong-kv-head" else 1
scores = (q[0, 3:6] @ k_seq[:, kv_head].T) * scale  # heads 3..5 read KV head 1
by_hand = scores.softmax(-1) @ v_seq[:, kv_head]
assert torch.allclose(by_hand, out[0, 3:6], atol=1e-5), (
    f"heads 3..5 read KV head {kv_head} by hand but not in the kernel: with {HQ} query heads and {HKV} KV "
    f"heads, query head h reads KV head h // {HQ // HKV}, so heads 3..5 share KV head 1")
console.print("softmax over the K/V rows at those slots reproduces the kernel's output for heads 3..5.")

# ---------------------------------------------------------------------------
section("3. Why split-K helps long contexts", """
With one program per (sequence, KV head), a batch of 2 sequences and 2 KV heads is 4 programs:
on a GPU with 132 multiprocessors, 128 of them idle while 4 walk the whole context. Split-K
cuts each sequence's positions into S slices, S times more programs, each returning its
normalised partial output and its log-sum-exp (lse). A second kernel combines them:
    out = sum_s w_s * out_s,   w_s = exp(lse_s - max lse) / sum_t exp(lse_t - max lse)
Here we launch the first kernel ourselves with S = 3 and combine the partial results in Python.
""")
S, BLOCK_N = 3, 4
tokens_per_split = 4                     # positions 0-3, 4-7, 8-11 of each sequence
part = torch.empty(2, HQ, S, D)
lse = torch.empty(2, HQ, S)
_paged_decode_kernel[(2, HKV, S)](
    q, k_cache, v_cache, block_tables, seq_lens, part, lse,
    q.stride(0), q.stride(1),
    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
    scale, tokens_per_split, 0,          # 0: no sliding window (Gemma 3's local layers pass theirs)
    GROUP=HQ // HKV, GROUP_PAD=16, HEAD_DIM=D, HEAD_DIM_PAD=D, BLOCK_SIZE=BS, BLOCK_N=BLOCK_N,
)
console.print(f"lse of sequence 0, head 3, per split: {lse[0, 3].tolist()}")
console.print(f"lse of sequence 1, head 3, per split: {lse[1, 3].tolist()}  (3 tokens: splits 2 and 3 are empty)")
assert torch.isinf(lse[1, :, 1:]).all(), "a split past the sequence's end has lse = -inf and weighs nothing"
w = torch.softmax(lse, dim=-1)                       # exp(lse_s - max) / sum: the combine weights
if BROKEN == "average-splits":
    w = torch.isfinite(lse).float() / torch.isfinite(lse).float().sum(-1, keepdim=True)
combined = (w.unsqueeze(-1) * torch.nan_to_num(part)).sum(dim=2)
assert torch.allclose(combined, want, atol=1e-5), (
    "the combined splits differ from the one-pass result: each split's output is normalised over its "
    "own positions only, so it must be weighted by its share of the softmax mass, exp(lse_s) / sum exp(lse)")
console.print("combined by their lse weights, the three partial results equal the one-pass result.")
split_kernel = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=3, block_n=4)
assert torch.allclose(split_kernel, want, atol=1e-5)
console.print(f"and the wrapper's own split path (decode_attention(..., num_splits=3)) agrees: grid "
              f"{(2, HKV, 3)} = {2 * HKV * 3} programs instead of {2 * HKV}.")
console.print("All checks passed (Triton's interpreter, on the CPU).", style="bold green")
