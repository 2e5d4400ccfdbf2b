"""The CPU attention backend ("cpu"): every row of a step through the C kernel of attention.c.

The torch backend (kernels/torch_backend.py) gathers each sequence's blocks
into a padded copy and masks it; this one hands the C kernel the block
tables themselves, and the kernel reads K/V in place. The kernel takes one
query per row, each with its own block table and length, so a whole step is
one call per layer:

    row of the step          table        length (tokens it attends)
    decode of seq a          a's table    len(a)
    prefill chunk of seq b,  b's table    ctx - Tq + 1, ctx - Tq + 2, ..., ctx
      Tq queries over ctx tokens

Query i of the chunk sits at position ctx - Tq + i, and causal attention lets
it see exactly the first ctx - Tq + i + 1 tokens: it *is* a decode over that
many tokens of the chunk's table. So no causal mask is built and nothing
above the diagonal is computed. The same library stores the step's new K/V
rows at their slots (`store`, as reference.store_kv).

It computes what the torch backend computes (tests/test_cpu_decode.py
compares them); the engine reports which one ran (`LLMEngine.implementation`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata, BatchLayout


@dataclass(slots=True)
class CpuMetadata(AttentionMetadata):
    block_tables: torch.Tensor | None = None   # [rows, nb] int64: each row's table, padded (padding never read)
    seq_lens: torch.Tensor | None = None       # [rows] int64: tokens each row attends


class CpuBackend(AttentionBackend):
    name = "cpu"
    windows = True      # a sliding window is each row's last W tokens: the kernel skips the ones before

    def __init__(self, attend, store) -> None:
        """`attend`, `store`: cpu/attention.py's load(dtype) and load_store(dtype), built for the cache's dtype."""
        self.attend = attend
        self.store = store

    @property
    def label(self) -> str:
        return "cpu (cpu/attention.c)"

    def prepare(self, layout: BatchLayout) -> CpuMetadata:
        """Each row's block table and length (the table above), once per step for every layer."""
        meta = CpuMetadata(self, layout.slot_mapping, layout.num_decodes)
        dev, nd = layout.device, layout.num_decodes
        # The runner puts decodes first, then each chunk's rows together, in order: the kernel's row i is
        # the step's row i. (A layout built otherwise would attend the wrong rows: refuse it.)
        start = nd
        for c in layout.prefills:
            if c.query_start != start:
                raise ValueError(f"the CPU backend needs prefill chunks in row order after the decodes: a chunk "
                                 f"starts at row {c.query_start}, expected {start}")
            start += c.num_query
        tables = layout.decode_block_tables + [c.block_table for c in layout.prefills]
        if not tables:
            return meta
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=dev)
        # A chunk's table once per query row (its rows share it); each decode's table once.
        repeats = torch.tensor([1] * nd + [c.num_query for c in layout.prefills], device=dev)
        lens = list(layout.decode_seq_lens)
        for c in layout.prefills:
            lens += range(c.context_len - c.num_query + 1, c.context_len + 1)
        meta.block_tables = padded.repeat_interleave(repeats, dim=0)
        meta.seq_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        # 1. Write this step's K/V first, so every query can see its own token.
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        # 2. One query per row, each over its own table and length (its last `window` tokens, if windowed).
        return self.attend(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window or 0)
