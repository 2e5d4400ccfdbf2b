"""The model runner: owns the KV cache tensors, turns a schedule into tensors, runs the model.

`prepare()` flattens the scheduled chunks into one row of tokens, single-token
chunks (decodes) first, and builds what attention needs to find K/V:

    input_ids    [T]  the tokens to compute
    positions    [T]  their positions in their own sequence
    slot_mapping [T]  where each token's K/V goes: table[pos // bs] * bs + pos % bs
    block tables      which physical blocks each sequence reads

`run()` does one forward pass over that row and returns logits only for the
chunks that reach their sequence's end (a mid-prompt chunk samples nothing).

The cache is one pair of tensors per layer, `[num_blocks, block_size,
num_kv_heads, head_dim]`, allocated once; blocks are handed out by the
block pool, which never touches these tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.attention import AttentionMetadata, PrefillChunk
from nanoserve.kernels.reference import decode_mask, prefill_mask
from nanoserve.scheduler import ScheduledChunk


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor      # [S] row index of the last token of each sampling chunk
    sampling_chunks: list[ScheduledChunk]   # the S chunks whose logits come back, in that order


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """K and V for `block_size` tokens in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # One (k_cache, v_cache) pair per layer.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]

    def prepare(self, chunks: list[ScheduledChunk]) -> Batch:
        bs = self.block_size
        # Single-token chunks go first so attention can batch them as decodes.
        ordered = [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]
        num_decodes = sum(1 for c in chunks if c.num_tokens == 1)

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        logits_indices: list[int] = []
        for chunk in ordered:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            table = seq.block_table
            row = len(input_ids)
            input_ids += seq.token_ids(start, start + n)
            pos = range(start, start + n)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            if n > 1:
                context = start + n
                table_t = self._tensor(table[: -(-context // bs)])
                prefills.append(PrefillChunk(row, n, context, table_t, prefill_mask(n, context, self.device)))
            if chunk.samples:
                logits_indices.append(row + n - 1)

        # Decode block tables, padded to the longest with block 0 (masked out by seq_lens).
        decode_chunks = ordered[:num_decodes]
        seq_lens = [c.start + 1 for c in decode_chunks]
        width = max((-(-L // bs) for L in seq_lens), default=0)
        tables = [c.seq.block_table[: -(-L // bs)] for c, L in zip(decode_chunks, seq_lens)]
        padded = [t + [0] * (width - len(t)) for t in tables]

        decode_seq_lens = self._tensor(seq_lens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=num_decodes,
            decode_block_tables=self._tensor(padded).view(num_decodes, width),
            decode_seq_lens=decode_seq_lens,
            decode_mask=decode_mask(decode_seq_lens, width * bs),
            prefills=prefills,
        )
        return Batch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            meta=meta,
            logits_indices=self._tensor(logits_indices),
            sampling_chunks=[c for c in ordered if c.samples],
        )

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """One forward pass; returns float32 logits [S, vocab] for the sampling chunks."""
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)   # [T, hidden]
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
