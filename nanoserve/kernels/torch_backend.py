"""The torch attention backend: the reference functions of kernels/reference.py, any device.

Per layer it stores the step's K/V at their slots, runs decode attention over
the decoding sequences, then each prefill chunk causally over its cached
prefix and itself. Every read of K/V goes through block tables.

Two ways, chosen once per engine (`grouped`: off on EngineConfig.path="reading"):

* plain  one `reference.decode_attention` call over all B decodes: every
         sequence's blocks are gathered into one [B, nb * bs, Hkv, D] copy,
         padded with block 0 up to the longest sequence and masked.
* grouped the runner puts decodes longest first and they are attended in
         groups of `group_size` neighbours, each padded only to its own
         longest, so a batch of mixed lengths gathers (and multiplies) far
         less padding. With `compute_dtype=float32` (the CPU fast path sets it
         for a bf16 cache on a CPU without bf16 units: no AVX512-BF16, no AMX)
         K/V are gathered in bf16, half the bytes, and multiplied in float32,
         where torch's CPU attention runs about 3x faster.

A sliding-window layer (`window=W`, Gemma 3's local layers) narrows the same
masks: a query at position p sees keys p - W + 1 .. p. The blocks before the
window are still gathered (freeing them is the KV cache groups' job).

Both paths compute the same attention (the tests compare them). On a CPU the
engine runs the C kernel of nanoserve/cpu/ instead where it builds (the "cpu"
backend, cpu/backend.py), which reads K/V in place with no copies at all.
Measured with benchmarks/bench_decode_attention.py on one core of an AMD EPYC
(AVX2), one layer of SmolLM2-135M, B = 32 decodes of 60-380 tokens, float32,
2026-11-24: plain 7.4 ms, groups 4.9-7.3 ms (two runs), the C kernel
2.4-2.5 ms. docs/benchmarks-notebook.md has the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata, BatchLayout
from nanoserve.kernels import reference


@dataclass(slots=True)
class DecodeGroup:
    """Decodes start..end-1 of the row, attended together (plain: all of them in one group)."""

    start: int
    end: int
    block_tables: torch.Tensor   # [end - start, nb] int64, padded with block 0 to the group's longest
    seq_lens: torch.Tensor       # [end - start] int64
    mask: torch.Tensor           # [end - start, 1, 1, nb * bs] bool: which gathered slots are real tokens


@dataclass(slots=True)
class PrefillPart:
    """One prefill chunk as the torch reference reads it."""

    start: int                   # first row of the chunk
    end: int
    context_len: int
    block_table: torch.Tensor    # [ceil(context_len / bs)] int64
    mask: torch.Tensor           # [num_query, context_len] bool causal mask after the cached prefix


@dataclass(slots=True)
class TorchMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillPart] = field(default_factory=list)


class TorchBackend(AttentionBackend):
    name = "torch"
    windows = True

    def __init__(self, grouped: bool = True, group_size: int = 8, compute_dtype: torch.dtype | None = None,
                 ops=reference):
        # The paged-attention functions (store_kv, decode_attention, prefill_attention, decode_mask,
        # prefill_mask): kernels/reference.py, or a student's copy of it (`nanoserve lab paged-attention`).
        self.ops = ops
        self.grouped = grouped
        self.group_size = group_size
        # None: multiply in the cache's dtype; float32: upcast a half-precision cache's K/V (grouped only).
        self.compute_dtype = compute_dtype

    @property
    def label(self) -> str:
        """"torch (kernels/reference.py, decodes in groups of 8)", or a lab's ops module in its place."""
        ops = "kernels/reference.py" if self.ops is reference else getattr(self.ops, "__name__", "ops")
        how = [f"decodes in groups of {self.group_size}"] if self.grouped else []
        if self.grouped and self.compute_dtype is not None:
            how.append(f"{str(self.compute_dtype)[6:]} math")
        return f"torch ({', '.join([ops, *how])})"

    def prepare(self, layout: BatchLayout) -> TorchMetadata:
        dev, bs = layout.device, layout.block_size
        meta = TorchMetadata(self, layout.slot_mapping, layout.num_decodes)
        nd, prefills = layout.num_decodes, layout.prefills
        size = self.group_size if self.grouped else max(nd, 1)
        for s in range(0, nd, size):
            tables, lens = layout.decode_block_tables[s : s + size], layout.decode_seq_lens[s : s + size]
            width = max(len(t) for t in tables)
            seq_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
            meta.decode_groups.append(DecodeGroup(
                s, s + len(tables),
                torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=dev),
                seq_lens, self.ops.decode_mask(seq_lens, width * bs)))
        for c in prefills:
            meta.prefills.append(PrefillPart(
                c.query_start, c.query_start + c.num_query, c.context_len,
                torch.tensor(c.block_table, dtype=torch.int64, device=dev),
                self.ops.prefill_mask(c.num_query, c.context_len, dev)))
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        # 1. Write this step's K/V first, so every query below can see its own token.
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        # 2. Decodes: one query each, batched (plain: one group; grouped: groups of similar length).
        for g in meta.decode_groups:
            mask = g.mask if window is None else decode_window(g.mask, g.seq_lens, window)
            out[g.start : g.end] = self._decode(q[g.start : g.end], k_cache, v_cache, g, scale, mask)
        # 3. Prefill chunks: causal over (cached prefix + chunk), one sequence at a time.
        for c in meta.prefills:
            mask = c.mask if window is None else prefill_window(c.mask, window)
            out[c.start : c.end] = self.ops.prefill_attention(
                q[c.start : c.end], k_cache, v_cache, c.block_table, c.context_len, scale, mask,
                compute_dtype=self.compute_dtype if self.grouped else None)
        return out

    def _decode(self, q, k_cache, v_cache, g: DecodeGroup, scale: float, mask: torch.Tensor) -> torch.Tensor:
        return self.ops.decode_attention(q, k_cache, v_cache, g.block_tables, g.seq_lens, scale, mask,
                                          compute_dtype=self.compute_dtype if self.grouped else None)


def decode_window(mask: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """A decode mask [B, 1, 1, L] narrowed to each sequence's last `window` tokens (the newest included)."""
    pos = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (pos[None, :] >= seq_lens[:, None] - window)[:, None, None, :]


def prefill_window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A chunk's causal mask [Tq, ctx] narrowed to keys less than `window` positions behind each query."""
    num_q, ctx = mask.shape
    q_pos = torch.arange(ctx - num_q, ctx, device=mask.device)
    k_pos = torch.arange(ctx, device=mask.device)
    return mask & (k_pos[None, :] > q_pos[:, None] - window)
