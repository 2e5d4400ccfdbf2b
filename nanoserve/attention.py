"""Attention over the paged KV cache: the backend interface, and the one call every model layer makes.

The runner flattens a mixed batch into one row of tokens, decodes first:

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      d = decode, p = prefill chunk
              one each    chunk of seq 3   chunk of seq 4

and describes that row once per step as a `BatchLayout`: plain Python lists
(lengths, block tables) plus the slot of every token. An `AttentionBackend`
turns the layout into the tensors *it* needs (`prepare`, once per step), and
then every layer calls `paged_attention`, which hands q, k, v to the backend:
write k, v into the cache at their slots, then attend, reading K/V back only
through block tables.

Three backends implement the interface:

* `TorchBackend`  (kernels/torch_backend.py)  kernels/reference.py's torch functions, any device
* `TritonBackend` (kernels/triton_backend.py) Triton kernels: on a GPU, or on a CPU
                                              under the Triton interpreter (tests, lessons)
* `CpuBackend`    (cpu/backend.py)            the CPU fast path's C kernel (what a CPU runs
                                              by default; nanoserve/cpu/)

Each builds only its own tensors: the torch backend's gathered block tables,
the Triton backend's per-chunk arrays for its one-launch prefill kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill chunk inside the flat token row."""

    query_start: int             # index of its first token in the flat row
    num_query: int               # tokens in the chunk
    context_len: int             # cached prefix + chunk
    block_table: list[int]       # exactly ceil(context_len / block_size) blocks


@dataclass(slots=True)
class BatchLayout:
    """A step's token row as plain data: what every backend builds its metadata from."""

    block_size: int
    slot_mapping: torch.Tensor             # [T] int64: cache slot of every token in the row
    decode_seq_lens: list[int]             # the first len(...) tokens are one decode each; new token included
    decode_block_tables: list[list[int]]   # each exactly ceil(seq_len / block_size) blocks (no padding)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seq_lens)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device


@dataclass(slots=True)
class AttentionMetadata:
    """What a step's layers share: the backend that built it, and its tensors (a backend's subclass adds them)."""

    backend: "AttentionBackend"
    slot_mapping: torch.Tensor   # [T] int64
    num_decodes: int


def layer_meta(meta: AttentionMetadata | list[AttentionMetadata], layer: int) -> AttentionMetadata:
    """The metadata layer `layer` reads: the step's one, or (KV cache groups, kv_groups.py: each group has
    its own block tables) its group's, from the runner's per-layer list."""
    return meta[layer] if isinstance(meta, list) else meta


class AttentionBackend:
    """The interface: `prepare` once per step, `forward` in every layer, `copy_blocks` for copy-on-write.

    A backend with `windows = True` takes `window=W` in `forward`: a query at position p then sees only
    the keys at positions p - W + 1 .. p (a sliding-window layer, as in Gemma 3 and Mistral)."""

    name = "base"
    windows = False

    @property
    def label(self) -> str:
        """What runs, for a reader: the backend's name and the file whose code attends."""
        return f"{self.name} ({type(self).__module__})"

    def prepare(self, layout: BatchLayout) -> AttentionMetadata:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def copy_blocks(self, caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """cache[dst[i]] = cache[src[i]] in every cache tensor."""
        for cache in caches:
            cache[dst] = cache[src]      # advanced indexing reads all of src before writing dst


def paged_attention(
    q: torch.Tensor,        # [T, Hq, D]
    k: torch.Tensor,        # [T, Hkv, D]
    v: torch.Tensor,        # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] this layer's cache
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:          # [T, Hq, D]
    """Store this step's k, v at their slots, then attend for every token of the row.

    `window`: a sliding-window layer's window (each query sees only its last `window` keys, itself
    included); None for full causal attention. A backend without window masks refuses it rather than
    attend to keys it should not.

    q, k and v may be views whose rows lie apart in memory (cpu/llama.py passes slices of one
    merged q/k/v matmul output); each head's head_dim values are contiguous."""
    if window is None:
        return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    if not meta.backend.windows:
        raise ValueError(f"attention backend {meta.backend.label} has no sliding-window mask, which this "
                         f"model's windowed layers need; use the torch backend")
    return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=window)
