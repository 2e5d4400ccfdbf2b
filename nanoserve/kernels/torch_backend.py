"""The torch attention backend: the reference functions of kernels/reference.py, any device.

Per layer it stores the step's K/V at their slots, runs decode attention over
the decoding sequences, then each prefill chunk causally over its cached
prefix and itself. Every read of K/V goes through block tables.

Two paths, chosen once per engine (`fast`, EngineConfig.fast_paths):

* plain  one `reference.decode_attention` call over all B decodes: every
         sequence's blocks are gathered into one [B, nb * bs, Hkv, D] copy,
         padded with block 0 up to the longest sequence and masked.
* fast   on a CPU, every row goes to a small C kernel (kernels/cpu_decode.c,
         `decode_kernel`) that reads K/V in place through the block tables:
         no copies, no padding, no masks. It takes one query per row, so a
         prefill chunk's query i is given as a decode over the first
         ctx - Tq + i + 1 tokens, exactly what causal attention lets it see
         (`_prepare_kernel`); the same library stores the step's K/V
         (`store_kernel`). Where it cannot be built (no C compiler, or
         EngineConfig.cpu_kernel=False), with a lab's `ops`, and on other
         devices, the runner puts decodes longest first and they are
         attended in groups of `group_size` neighbours, each padded only to
         its own longest, so a batch of mixed lengths gathers (and
         multiplies) far less padding.
         With `compute_dtype=float32` (the runner sets it for a bf16 cache on
         a CPU without bf16 units: no AVX512-BF16, no AMX) K/V are gathered
         in bf16, half the bytes, and multiplied in float32, where torch's
         CPU attention runs about 3x faster; the C kernel does the same.

All paths compute the same attention (the tests compare them). Measured with
benchmarks/bench_decode_attention.py on one core of an AMD EPYC (AVX2), one
layer of SmolLM2-135M, B = 32 decodes of 60-380 tokens, float32, 2026-11-24:
plain 7.4 ms, groups 4.9-7.3 ms (two runs), C kernel 2.4-2.5 ms. A 256-token
prefill chunk, one core: torch's SDPA (gather, mask, flash kernel) 6.6 ms, its
rows in the C kernel 4.5 ms (no work above the diagonal). docs/benchmarks-notebook.md
has the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata, BatchLayout
from nanoserve.kernels import reference


def cpu_has_bf16_units() -> bool:
    """Does this CPU multiply bf16 in hardware (AVX512-BF16 or AMX)? torch's bf16 kernels need them to be fast."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


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
    kernel_tables: torch.Tensor | None = None    # C kernel: [kernel_rows, nb] each row's table (padding never read)
    kernel_lens: torch.Tensor | None = None      # C kernel: [kernel_rows] int64 tokens each row attends
    prefills: list[PrefillPart] = field(default_factory=list)

    @property
    def kernel_rows(self) -> int:
        """The C kernel attends rows 0..kernel_rows-1 of the step, one query each (0: it does not run)."""
        return 0 if self.kernel_lens is None else self.kernel_lens.shape[0]


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, fast: bool = True, group_size: int = 8, compute_dtype: torch.dtype | None = None,
                 ops=reference):
        # The paged-attention functions (store_kv, decode_attention, prefill_attention, decode_mask,
        # prefill_mask): kernels/reference.py, or a student's copy of it (`nanoserve lab paged-attention`).
        self.ops = ops
        self.fast = fast
        self.group_size = group_size
        # None: multiply in the cache's dtype; float32: upcast a half-precision cache's K/V (fast path only).
        self.compute_dtype = compute_dtype
        # Fast path: cpu_decode.load(cache dtype), set by the runner on a CPU; None: the grouped torch path.
        # It stands in for reference.decode_attention and prefill_attention (see _prepare_kernel); a
        # student's `ops` (a lab) is always called instead.
        self.decode_kernel = None
        # Fast path: cpu_decode.load_store(cache dtype), the reference's store_kv in one C call; None: the reference.
        self.store_kernel = None

    def prepare(self, layout: BatchLayout) -> TorchMetadata:
        dev, bs = layout.device, layout.block_size
        meta = TorchMetadata(self, layout.slot_mapping, layout.num_decodes)
        nd, prefills = layout.num_decodes, layout.prefills
        if self.fast and self.decode_kernel is not None and self.ops is reference:
            nd, prefills = self._prepare_kernel(layout, meta)    # what the torch paths still have to do
        size = self.group_size if self.fast else max(nd, 1)
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

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        # 1. Write this step's K/V first, so every query below can see its own token.
        if self.fast and self.store_kernel is not None and self.ops is reference:
            self.store_kernel(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if 0 < meta.kernel_rows == q.shape[0]:      # a CPU's usual step: the C kernel attends every row
            return self.decode_kernel(q, k_cache, v_cache, meta.kernel_tables, meta.kernel_lens, scale)
        out = torch.empty_like(q)
        # 2. Decodes: one query each, batched (plain: one group; fast: the C kernel, or groups of similar length).
        #    (The C kernel, where it runs, attends the prefill chunks' rows here too: see _prepare_kernel.)
        if meta.kernel_rows:
            n = meta.kernel_rows
            out[:n] = self.decode_kernel(q[:n], k_cache, v_cache, meta.kernel_tables, meta.kernel_lens, scale)
        for g in meta.decode_groups:
            out[g.start : g.end] = self._decode(q[g.start : g.end], k_cache, v_cache, g, scale)
        # 3. Prefill chunks: causal over (cached prefix + chunk), one sequence at a time.
        for c in meta.prefills:
            out[c.start : c.end] = self.ops.prefill_attention(
                q[c.start : c.end], k_cache, v_cache, c.block_table, c.context_len, scale, c.mask,
                compute_dtype=self.compute_dtype if self.fast else None)
        return out

    def _prepare_kernel(self, layout: BatchLayout, meta: TorchMetadata) -> tuple[int, list]:
        """The C kernel's rows: every decode, and every prefill chunk's rows when they follow them in order.

        The kernel takes one query per row, each with its own block table and length. A decode row attends
        its whole sequence. Query i of a prefill chunk of Tq queries over ctx tokens sits at position
        ctx - Tq + i, and causal attention lets it see exactly the first ctx - Tq + i + 1 tokens: it is a
        decode over that many tokens of the chunk's table. So the chunk becomes Tq rows sharing one table
        with lengths ctx - Tq + 1, ..., ctx, and one C call per layer attends the whole step, reading K/V in
        place, with no causal mask and nothing computed above the diagonal.
        Returns what the torch paths still have to do: (decodes, prefill chunks)."""
        prefills, nd, dev = layout.prefills, layout.num_decodes, layout.device
        starts = accumulate((c.num_query for c in prefills), initial=nd)     # where each chunk's rows should start
        if any(c.query_start != start for c, start in zip(prefills, starts)):
            prefills_in_c = []          # rows not where the kernel's rows go on (the runner never builds that)
        else:
            prefills_in_c, prefills = prefills, []
        tables = layout.decode_block_tables + [c.block_table for c in prefills_in_c]
        if not tables:
            return 0, prefills
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=dev)
        # Each chunk's table once per query row (a chunk's rows share it); decodes' tables once each.
        repeats = torch.tensor([1] * nd + [c.num_query for c in prefills_in_c], device=dev)
        lens = list(layout.decode_seq_lens)
        for c in prefills_in_c:
            lens += range(c.context_len - c.num_query + 1, c.context_len + 1)
        meta.kernel_tables = padded.repeat_interleave(repeats, dim=0)
        meta.kernel_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        return 0, prefills

    def _decode(self, q, k_cache, v_cache, g: DecodeGroup, scale: float) -> torch.Tensor:
        return self.ops.decode_attention(q, k_cache, v_cache, g.block_tables, g.seq_lens, scale, g.mask,
                                          compute_dtype=self.compute_dtype if self.fast else None)
