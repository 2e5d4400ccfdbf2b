"""Lab paged-attention: slots, block tables and causal masks in plain torch (nanoserve/kernels/reference.py).

The student writes `store_kv` (each new K/V row to its slot), `gather_kv`
(read a sequence's blocks in table order), `decode_mask` and `prefill_mask`
(which gathered positions a query may see: its own sequence's real tokens,
causally over the cached prefix and the chunk). `decode_attention` and
`prefill_attention` stay, calling the student's functions. The engine's
torch backend takes the student's module as its `ops` (`Components.
attention_backend`), and the checks compare with dense attention and with
the engine's own tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.components import Components
from nanoserve.kernels.backends import make_backend
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, same_as_engine
from nanoserve.labs.lab import Check, Context, Lab, expect

N, BS, H, D = 6, 4, 2, 3


def _backend_for(module):
    def make(name: str, grouped: bool):
        if name != "torch":
            return make_backend(name, grouped)
        from nanoserve.kernels.torch_backend import TorchBackend
        return TorchBackend(grouped=grouped, ops=module)
    return make


def store(ctx: Context) -> None:
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(N, BS, H, D), torch.zeros(N, BS, H, D)
    k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
    slots = torch.tensor([13, 0, 6])              # block 3 offset 1, block 0 offset 0, block 1 offset 2
    ctx.module.store_kv(k, v, k_cache, v_cache, slots)
    for cache, new, name in ((k_cache, k, "k"), (v_cache, v, "v")):
        for t, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BS)
            expect(torch.equal(cache[block, offset], new[t]),
                   f"{name} of token {t} is not at slot {slot} (block {block}, offset {offset})",
                   "write token t at slot_mapping[t]: view the cache as [num_blocks * block_size, H, D] "
                   "(slot = block * block_size + offset) and index_copy_ along dim 0; the same for v")
        written = (cache.abs().sum(dim=(2, 3)) > 0).sum().item()
        expect(written == 3, f"{written} slots of {name}_cache changed, expected exactly 3",
               "write only the slots in slot_mapping")


def gather(ctx: Context) -> None:
    cache = torch.arange(N * BS * H * D, dtype=torch.float32).view(N, BS, H, D)
    tables = torch.tensor([[3, 1], [0, 5]])
    got = ctx.module.gather_kv(cache, tables)
    want = torch.stack([torch.cat([cache[3], cache[1]]), torch.cat([cache[0], cache[5]])])
    expect(tuple(got.shape) == (2, 2 * BS, H, D), f"gather_kv gave shape {tuple(got.shape)}, expected (2, 8, 2, 3)",
           "gather_kv returns [B, num_blocks_per_table * block_size, H, D]")
    expect(torch.equal(got, want), "gather_kv's rows are not the tables' blocks in table order",
           "position j of row b is token j of sequence b: block block_tables[b][j // block_size], offset "
           "j % block_size; keep the table's order (a table is not sorted)")


def decode_mask(ctx: Context) -> None:
    for lens, L in (([5, 2], 8), ([8], 8), ([1, 3, 4], 4)):
        got = ctx.module.decode_mask(torch.tensor(lens), L)
        want = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        expect(tuple(got.shape) == (len(lens), 1, 1, L) and torch.equal(got.bool(), want),
               f"decode_mask({lens}, {L}) is {got.reshape(len(lens), -1).int().tolist()} (shape {tuple(got.shape)})",
               "a decode sees only the first seq_lens[b] positions of its gathered row (the rest is padding or "
               "unused slots of its last block); shape [B, 1, 1, L]")


def prefill_mask(ctx: Context) -> None:
    for num_q, context_len in ((3, 7), (4, 4), (1, 5)):
        got = ctx.module.prefill_mask(num_q, context_len, "cpu")
        want = torch.arange(context_len)[None, :] <= torch.arange(context_len - num_q, context_len)[:, None]
        expect(tuple(got.shape) == (num_q, context_len) and torch.equal(got.bool(), want),
               f"prefill_mask({num_q}, {context_len}) is {got.int().tolist()}",
               "query i of a chunk sits at absolute position context_len - num_q + i: it sees the whole cached "
               "prefix plus the chunk up to itself (causal over the cached prefix)")


def dense(ctx: Context) -> None:
    """The student's attention through a shuffled paged cache equals dense causal attention."""
    m = ctx.module
    g = torch.Generator().manual_seed(1)
    L, Hq = 10, 4                                                 # 10 tokens: 3 blocks, the last partly filled
    q, k, v = (torch.randn(L, n, D, generator=g) for n in (Hq, H, H))
    table = torch.tensor([4, 0, 2])
    slots = table[torch.arange(L) // BS] * BS + torch.arange(L) % BS
    k_cache, v_cache = torch.zeros(N, BS, H, D), torch.zeros(N, BS, H, D)
    m.store_kv(k, v, k_cache, v_cache, slots)
    rep = lambda t: t.repeat_interleave(Hq // H, dim=1).transpose(0, 1)   # noqa: E731  [Hq, L, D]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), rep(k), rep(v), is_causal=True).transpose(0, 1)
    got = m.prefill_attention(q[6:], k_cache, v_cache, table, L, D ** -0.5)
    expect(torch.allclose(got, want[6:], atol=1e-5), "a 4-token chunk after a 6-token cached prefix does not "
           "match dense causal attention", "the chunk's queries attend to the cached prefix and to the chunk "
           "causally: check prefill_mask and gather_kv")
    got = m.decode_attention(q[9:], k_cache, v_cache, table[None], torch.tensor([L]), D ** -0.5)
    expect(torch.allclose(got, want[9:], atol=1e-5), "decode of token 9 does not match dense attention",
           "the decode sees tokens 0..9 through the block table and nothing past them")


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts(4, 13, shared=8))]
    for path in ("fast", "reading"):
        same_as_engine(ctx, reqs, {"num_blocks": 32, "max_num_batched_tokens": 16, "path": path},
                       "the engine's tokens differ with your attention (prefix hits, chunked prefill, batched "
                       "decodes of different lengths): check the masks against padding and the cached prefix")


LAB = Lab(
    name="paged-attention",
    title="paged attention in torch: slots, block tables, causal over a cached prefix",
    module="nanoserve.kernels.reference",
    blanks={
        "store_kv": "view each cache as [num_blocks * block_size, H, D] and copy k[t] (v[t]) to row "
                    "slot_mapping[t] (index_copy_)",
        "gather_kv": "index_select the blocks named by the tables (flattened) and view them as "
                     "[B, nb * block_size, H, D]",
        "decode_mask": "valid[b, j] = j < seq_lens[b]; return it as [B, 1, 1, L]",
        "prefill_mask": "query i is at position context_len - num_q + i; it may see keys 0..that position",
    },
    contracts={
        "store_kv": "Afterwards row slot_mapping[t] of each cache, viewed as [num_blocks * block_size, H, D] "
                    "(slot = block * block_size + offset), holds k[t] (v[t]); no other slot changes.",
        "gather_kv": "Returns [B, nb * block_size, H, D]: position j of row b is slot j % block_size of block "
                     "block_tables[b][j // block_size], in the table's order.",
        "decode_mask": "[B, 1, 1, L] bool: True exactly at positions j < seq_lens[b].",
        "prefill_mask": "[num_q, context_len] bool: query i (absolute position context_len - num_q + i) sees "
                        "keys 0..its own position, and nothing after it.",
    },
    invariants="Token t of a sequence lives in block table[t // block_size] at offset t % block_size. "
               "Attention through the paged cache equals dense causal attention over the sequence's tokens.",
    components=lambda m: Components(attention_backend=_backend_for(m)),
    checks=(
        SIGNATURES,
        Check("store_kv: each token at its slot", store, "write token t at slot_mapping[t], k and v", 30,
              function="store_kv"),
        Check("gather_kv: blocks in table order", gather, "read blocks through the table, in its order", 30,
              function="gather_kv"),
        Check("decode_mask: only a row's real tokens", decode_mask,
              "decode: only the first seq_lens[b] positions", 30, function="decode_mask"),
        Check("prefill_mask: causal over the cached prefix", prefill_mask,
              "prefill: the cached prefix, then causal over the chunk", 30, function="prefill_mask"),
        Check("paged = dense attention", dense, "store, gather and mask must agree with dense attention", 60),
        Check("real engine: same tokens (fast and plain paths)", engine_runs,
              "run the engine with your attention and compare", 240),
    ),
    why=(
        ("Why does a decode need a mask at all, when its block table lists only its own blocks?",
         "Rows of a batch are padded to the longest table, and a sequence's last block is usually partly "
         "filled: the gathered row holds stale KV of whoever used those slots before. Without the mask the "
         "query attends to another request's tokens."),
        ("Why is a prefill chunk's mask not a plain lower triangle?",
         "The chunk's queries start at position context_len - num_q, not 0: every one of them must see the "
         "whole cached prefix (earlier chunks, or a prefix-cache hit), and causality applies only within the "
         "chunk."),
        ("Why write the step's K/V into the cache before attending, not after?",
         "Every query attends to itself: a decode's own token and each chunk token's predecessors in the "
         "same chunk are in the cache only once they are written."),
    ),
    prerequisites="torch tensors; lesson 9 (the runner and attention)",
    minutes=45,
)
