"""The Triton attention backend: store, batched decode, and every prefill chunk in one launch.

It builds only what its kernels read: the decodes' block tables padded into
one [B, nb] tensor (a kernel stops at each sequence's length, so the padding
is never read) and the prefill chunks as arrays, one entry per chunk. The
kernels themselves are triton_cache.py, triton_decode.py and triton_prefill.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata, BatchLayout


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    decode_block_tables: torch.Tensor | None = None   # [B, nb] int64, padded with block 0
    decode_seq_lens: torch.Tensor | None = None       # [B] int64
    prefill_block_tables: torch.Tensor | None = None  # [C, nb] int64, padded with block 0
    prefill_query_start: torch.Tensor | None = None   # [C] first row of each chunk
    prefill_query_len: torch.Tensor | None = None     # [C]
    prefill_context_len: torch.Tensor | None = None   # [C]
    max_query_len: int = 0                            # longest chunk (sizes the launch grid)


def padded(tables: list[list[int]], device) -> torch.Tensor:
    """Block tables of different lengths as one [len(tables), widest] int64 tensor, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64,
                        device=device).view(len(tables), width)


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, decode=None, prefill=None) -> None:
        # The modules whose decode_attention / prefill_attention run (None: triton_decode, triton_prefill;
        # `nanoserve lab triton-decode` passes the same kernels built around a student's softmax step).
        self.decode, self.prefill = decode, prefill

    @property
    def label(self) -> str:
        if self.decode is None and self.prefill is None:
            return "triton (kernels/triton_decode.py, triton_prefill.py)"
        return "triton (" + ", ".join(getattr(m, "__name__", "kernels") for m in (self.decode, self.prefill) if m) + ")"

    def prepare(self, layout: BatchLayout) -> TritonMetadata:
        dev = layout.device
        meta = TritonMetadata(self, layout.slot_mapping, layout.num_decodes)
        if layout.num_decodes:
            meta.decode_block_tables = padded(layout.decode_block_tables, dev)
            meta.decode_seq_lens = torch.tensor(layout.decode_seq_lens, dtype=torch.int64, device=dev)
        if layout.prefills:
            chunks = layout.prefills
            meta.prefill_block_tables = padded([c.block_table for c in chunks], dev)
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
            meta.prefill_query_start = as_tensor([c.query_start for c in chunks])
            meta.prefill_query_len = as_tensor([c.num_query for c in chunks])
            meta.prefill_context_len = as_tensor([c.context_len for c in chunks])
            meta.max_query_len = max(c.num_query for c in chunks)
        return meta

    @property
    def windows(self) -> bool:
        """Our kernels take a sliding window; a lab's kernels in their place are called as they were written."""
        return self.decode is None and self.prefill is None

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        from nanoserve.kernels import triton_cache, triton_decode, triton_prefill

        triton_decode, triton_prefill = self.decode or triton_decode, self.prefill or triton_prefill
        windowed = {} if window is None else {"window": window}    # (paged_attention checked `windows`)
        triton_cache.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = triton_decode.decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, **windowed)
        if meta.prefill_block_tables is not None:
            triton_prefill.prefill_attention(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start, meta.prefill_query_len,
                meta.prefill_context_len, scale, max_query_len=meta.max_query_len, out=out, **windowed)
        return out

    def copy_blocks(self, caches, src, dst) -> None:
        from nanoserve.kernels import triton_cache
        triton_cache.copy_blocks(caches, src, dst)

