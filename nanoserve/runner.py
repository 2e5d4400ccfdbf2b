"""The model runner: owns the KV cache tensors, turns a schedule into tensors, runs the model.

`prepare()` flattens the scheduled chunks into one row of tokens, single-token
chunks (decodes) first, longest first, and describes it:

    input_ids    [T]  the tokens to compute
    positions    [T]  their positions in their own sequence
    slot_mapping [T]  where each token's K/V goes: table[pos // bs] * bs + pos % bs
    block tables      which physical blocks each sequence reads

The attention backend (attention.py: torch or Triton) turns that
description into the tensors its kernels read, and nothing else.

`run()` does one forward pass over that row and returns logits only for the
rows that need them: the last token of a chunk that reaches its sequence's
end (a mid-prompt chunk samples nothing), or every draft position when
speculative decoding verifies k drafted tokens at once.

The runner knows nothing of schedulers or requests: it takes `RunInput`s
(tokens, start position, block table), so the draft model of speculative
decoding uses the same class over its own cache.

The cache is one pair of tensors per layer, `[num_blocks, block_size,
num_kv_heads, head_dim]`, allocated once; blocks are handed out by the
block pool, which never touches these tensors. With KV cache groups
(kv_groups.py: Gemma 3's local and global layers) a pair serves slot s of
every group, and each layer reads its own group's block tables: `prepare`
builds one layout per group, and a layer gets its group's metadata. Block moves the scheduler
plans are carried out here, before the forward that needs them:
`copy_blocks` (copy-on-write, on the device) and `swap_out`/`swap_in`
(between the device cache and a CPU copy of it, pinned when on CUDA).

Which model view, attention backend and cache allocation run is decided
once, in implementation.py (`choose`, then `build`): on a CPU on the "fast"
path (the default) they come from nanoserve/cpu/ (C kernels, packed
weights, 2 MB pages); `path="reading"` runs the models in models/ and
kernels/reference.py's attention, nothing else, the same tokens.
`implementation` says what runs.

CUDA graphs (`graphs`, on for CUDA unless `enforce_eager`): a pure-decode step
is padded to a batch-size bucket and replays that bucket's graph; the
bookkeeping is cuda_graphs.py's, and the cache gets one scratch block for the
padding rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from nanoserve import implementation
from nanoserve.attention import AttentionBackend, AttentionMetadata, BatchLayout, PrefillChunk
from nanoserve.cuda_graphs import DecodeGraphs, GraphBatch
from nanoserve.errors import FieldError
from nanoserve.implementation import Choice, Implementation
from nanoserve.kernels.backends import make_backend
from nanoserve.kv_groups import FREED, KVGroup


@dataclass(slots=True)
class RunInput:
    """One sequence's slice of a forward pass, in terms the runner needs (no scheduler types)."""

    token_ids: list[int]          # the tokens to compute, at positions start, start + 1, ...
    start: int                    # position of the first one (= tokens already in the cache)
    block_table: list[int]        # covers at least start + len(token_ids) tokens
    num_logits: int = 1           # logits wanted for the last num_logits tokens (0: none)
    group_tables: list[list[int]] = field(default_factory=list)   # KV cache groups 1.. (kv_groups.py)


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    meta: AttentionMetadata | list    # built by the attention backend from the step's BatchLayout
                                      # (KV cache groups: one per layer, its group's)
    logits_indices: torch.Tensor      # [S] rows whose logits come back, in the order of the inputs


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """K and V for `block_size` tokens in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def kv_budget(model: nn.Module, config, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one KV block in one process's pool, and of one block of the draft model's pool (0 without one).

    With tensor parallelism each rank's pool holds 1/N of every block: the budget is per rank."""
    if config.tensor_parallel_size > 1:   # N must split the heads before a block is split by N
        from nanoserve.distributed.sharding import check_shardable
        check_shardable(model, config.tensor_parallel_size)
    block_bytes = kv_bytes_per_block(model, config.block_size, dtype) // config.tensor_parallel_size
    if config.speculative_method != "draft":
        return block_bytes, 0
    if config.draft_model is not None:    # the draft model's pool: as many blocks
        return block_bytes, block_bytes
    return block_bytes, block_bytes * min(config.draft_num_layers, model.num_layers) // model.num_layers   # fewer layers


class ModelRunner:
    @classmethod
    def from_config(cls, model: nn.Module, config, dtype: torch.dtype, choice: Choice,
                    make_attention: Callable[[str, bool], AttentionBackend] = make_backend,
                    groups: list[KVGroup] | None = None) -> ModelRunner:
        """The runner an EngineConfig asks for (`choice`: implementation.choose(config)), in this process."""
        # (KV cache groups: the pool holds num_blocks blocks of every layer, in blocks of one group's layers)
        return cls(model, config.num_blocks * len(groups or [None]), config.block_size, dtype,
                   torch.device(config.device), choice, make_attention=make_attention, groups=groups)

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, choice: Choice = Choice(),
                 make_attention: Callable[[str, bool], AttentionBackend] = make_backend,
                 groups: list[KVGroup] | None = None) -> None:
        """`groups`: the KV cache groups (kv_groups.py; None: one group, every layer its own tensors).
        `choice`: which path and attention backend run, and the CUDA-graph settings (implementation.py
        builds them; `make_attention` builds "torch" and "triton", components.py). With `choice.graphs`,
        pure-decode steps are padded to batch-size buckets and replayed as CUDA graphs (cuda_graphs.py)."""
        self.block_size = block_size
        self.device = device
        built = implementation.build(model, dtype, device, choice, make_attention)
        self.model, self.attn = built.model, built.attention
        self.implementation: Implementation = built.implementation
        zeros, graphs = built.zeros, choice.graphs
        self.groups = groups or [KVGroup(None, tuple(range(model.num_layers)))]
        if len(self.groups) > 1:
            graphs = None     # (CUDA graphs replay one block table per sequence: grouped models run eagerly)
        if any(w is not None for w in getattr(model, "sliding_windows", ())) and not self.attn.windows:
            raise FieldError("attention_backend", f"runs {self.attn.label}, which has no sliding-window mask, "
                                                  f"and this model's local layers need one")
        # With graphs, one scratch block past the pool's last: padding rows write their K/V there.
        shape = (num_blocks + (graphs is not None), block_size, model.num_kv_heads, model.head_dim)
        # One (k_cache, v_cache) pair per layer of a group: slot s of every group shares it (a block id
        # names the same bytes in any group), and layer l reads the slot of its place in its group.
        self.slot_caches = [(zeros(shape, dtype), zeros(shape, dtype)) for _ in self.groups[0].layers]
        self.layer_group = [0] * model.num_layers          # layer -> its group
        self.kv_caches = [self.slot_caches[0]] * model.num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.layer_group[layer], self.kv_caches[layer] = g, self.slot_caches[slot]

        self.cpu_caches: list[tuple[torch.Tensor, torch.Tensor]] = []   # swap space, see allocate_swap
        self.graphs = DecodeGraphs(self, graphs, pad_block=num_blocks) if graphs is not None else None
        self.replayed_bucket = 0        # the bucket the last forward ran padded to (0: it ran eagerly)
        if graphs is not None and graphs.capture:
            self.graphs.capture_all()

    def allocate_swap(self, num_cpu_blocks: int) -> None:
        """A CPU copy of the cache layout with `num_cpu_blocks` blocks per layer (swap preemption)."""
        k, _ = self.slot_caches[0]
        shape = (num_cpu_blocks, *k.shape[1:])
        pin = self.device.type == "cuda"      # pinned pages make device <-> host copies fast and async
        self.cpu_caches = [(torch.zeros(shape, dtype=k.dtype, pin_memory=pin),
                            torch.zeros(shape, dtype=k.dtype, pin_memory=pin)) for _ in self.slot_caches]

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block dst = device block src, in every layer's K and V."""
        if not pairs:
            return
        src = self._tensor([s for s, _ in pairs])
        dst = self._tensor([d for _, d in pairs])
        self.attn.copy_blocks([c for kv in self.slot_caches for c in kv], src, dst)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block): copy each device block's KV to its CPU block."""
        self._move(pairs, self.slot_caches, self.cpu_caches)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block): copy each CPU block's KV back into its (fresh) device block."""
        self._move(pairs, self.cpu_caches, self.slot_caches)

    @torch.inference_mode()
    def _move(self, pairs: list[tuple[int, int]], src_caches, dst_caches) -> None:
        """For every layer's K and V: dst_cache[dst] = src_cache[src], across devices."""
        if not pairs:
            return
        src_device, dst_device = src_caches[0][0].device, dst_caches[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=src_device)
        dst = torch.tensor([d for _, d in pairs], device=dst_device)
        # Host -> device from pinned memory may be asynchronous (the stream orders it before the
        # forward); device -> host must finish before the CPU copy is read, so it blocks.
        non_blocking = dst_device.type == "cuda"
        for src_kv, dst_kv in zip(src_caches, dst_caches):
            for src_cache, dst_cache in zip(src_kv, dst_kv):
                dst_cache[dst] = src_cache[src].to(dst_device, non_blocking=non_blocking)

    def prepare(self, inputs: list[RunInput]) -> Batch | GraphBatch:
        if any(not x.token_ids for x in inputs):
            raise ValueError("every RunInput needs at least one token")
        if self.graphs is not None and (padded := self.graphs.prepare(inputs)) is not None:
            return padded                   # a pure-decode step: padded to a bucket, run by its graph
        # Single-token inputs (decodes) go first, longest first, so a backend can attend them in
        # groups of similar length; then the prefill chunks in input order.
        order = sorted(range(len(inputs)),
                       key=lambda i: (len(inputs[i].token_ids) > 1,
                                      -inputs[i].start if len(inputs[i].token_ids) == 1 else 0))
        input_ids: list[int] = []
        positions: list[int] = []
        first_row = [0] * len(inputs)        # where each input starts in the flat row
        for i in order:
            first_row[i] = len(input_ids)
            input_ids += inputs[i].token_ids
            positions += range(inputs[i].start, inputs[i].start + len(inputs[i].token_ids))
        # Logits rows in input order: the last num_logits tokens of each input.
        logits_indices = [first_row[i] + len(x.token_ids) - x.num_logits + j
                          for i, x in enumerate(inputs) for j in range(x.num_logits)]
        metas = [self.attn.prepare(self._layout(inputs, order, first_row, g)) for g in range(len(self.groups))]
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.layer_group]   # grouped: per layer
        return Batch(self._tensor(input_ids), self._tensor(positions), meta, self._tensor(logits_indices))

    def _layout(self, inputs: list[RunInput], order: list[int], first_row: list[int], group: int) -> BatchLayout:
        """The step's row as KV cache group `group`'s layers see it: its slots and its block tables.

        A windowed group's FREED entries (blocks its window passed, kv_groups.py) are read as block 0:
        the window mask hides those positions (kernels/torch_backend.py's decode_window and
        prefill_window; the C and Triton kernels start at the window), so no weight falls on them."""
        bs = self.block_size
        slots: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        for i in order:
            x = inputs[i]
            n, table = len(x.token_ids), x.block_table if group == 0 else x.group_tables[group - 1]
            pos = range(x.start, x.start + n)
            slots += [table[p // bs] * bs + p % bs for p in pos]
            context = x.start + n
            blocks = table[: -(-context // bs)]           # exactly the blocks holding its context
            if group:
                blocks = [0 if b == FREED else b for b in blocks]
            if n == 1:
                decode_lens.append(context)
                decode_tables.append(blocks)
            else:
                prefills.append(PrefillChunk(first_row[i], n, context, blocks))
        return BatchLayout(bs, self._tensor(slots), decode_lens, decode_tables, prefills)

    @torch.inference_mode()
    def run(self, batch: Batch | GraphBatch) -> torch.Tensor:
        """One forward pass; returns float32 logits [S, vocab] for the requested rows."""
        self.replayed_bucket = batch.bucket if isinstance(batch, GraphBatch) else 0
        if isinstance(batch, GraphBatch):
            return self.graphs.run(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)   # [T, hidden]
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
