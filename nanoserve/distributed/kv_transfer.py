"""Moving a request's KV from one engine's pool into another's, through a block mapping.

Out of the sender's pool: `export_blocks` copies the blocks of a request's
table, in table order, from every layer's K and V cache into one tensor

    payload [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

(block-major, so a request's KV is one contiguous run of bytes to send).
On the receiving side `adopt` takes fresh blocks from *its own* pool (any
ids: the mapping src block i -> dst block i is the whole point of paging)
and `import_blocks` writes the payload into them. Then the request enters
the receiving engine as if it had computed those tokens itself: RUNNING,
`num_computed_tokens` = the tokens that came, a block table of the new
blocks. Its next step computes the rest (the last prompt token, whose
logits give the first output token) and decoding goes on.

`digest` hashes a payload, so both sides can check that what arrived is
byte for byte what left.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

import torch

from nanoserve import events as ev
from nanoserve.sequence import SequenceStatus

if TYPE_CHECKING:                      # (a type only: engine.py imports this module)
    from nanoserve.engine import LLMEngine

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]   # per layer (k_cache, v_cache) [N, bs, Hkv, D]


def export_blocks(caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """A copy of `block_ids`' KV, [len(block_ids), layers, 2, bs, Hkv, D]."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0][0].device)
    per_layer = [torch.stack([k.index_select(0, index), v.index_select(0, index)], dim=1) for k, v in caches]
    return torch.stack(per_layer, dim=1).cpu()          # [n, layers, 2, bs, Hkv, D]


def import_blocks(caches: KVCaches, block_ids: list[int], payload: torch.Tensor) -> None:
    """Write payload block i into pool block block_ids[i], in every layer's K and V."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0][0].device)
    payload = payload.to(caches[0][0].device)
    for layer, (k, v) in enumerate(caches):
        k.index_copy_(0, index, payload[:, layer, 0].to(k.dtype))
        v.index_copy_(0, index, payload[:, layer, 1].to(v.dtype))


def payload_shape(caches: KVCaches, num_blocks: int) -> tuple[int, ...]:
    k = caches[0][0]
    return (num_blocks, len(caches), 2, *k.shape[1:])


def digest(payload: torch.Tensor) -> str:
    """A short hash of a payload's bytes."""
    return hashlib.sha256(payload.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def adopt(engine: LLMEngine, request_id: str, prompt, params, payload: torch.Tensor | None, num_tokens: int,
          src_block_ids: list[int], src: str = "prefill", dst: str = "decode", seconds: float = 0.0) -> list[int]:
    """Add a request to `engine` with the KV of its first `num_tokens` tokens already in `payload`.

    Returns the blocks of `engine`'s pool the payload went into (empty when no KV came: the
    request then waits and computes its prompt like any other). The caller checked that the
    pool has the blocks and the scheduler the seats.
    """
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)      # validation, the sequence, RequestAdded
    step = engine.step_count
    if not num_tokens:   # a one-token prompt: nothing came, it waits and computes its token here
        engine.emit(ev.KVTransferred(step, request_id, src, dst, (), (), 0, 0, seconds))
        return []
    seq = engine.sequences[request_id]
    scheduler = engine.scheduler
    blocks = engine.kv.pool.allocate(engine.kv.pool.blocks_needed(0, num_tokens))
    import_blocks(engine.runner.kv_caches, blocks, payload)
    scheduler.waiting.remove(seq)                       # it skips the queue: its prompt is (nearly) done
    seq.block_table, seq.num_computed_tokens = list(blocks), num_tokens
    seq.set_status(SequenceStatus.RUNNING)
    scheduler.running.append(seq)
    engine.emit(ev.SequenceAdmitted(step, request_id))
    engine.emit(ev.BlocksAllocated(step, request_id, tuple(blocks)))
    engine.emit(ev.KVTransferred(step, request_id, src, dst, tuple(src_block_ids), tuple(blocks), num_tokens,
                                  payload.numel() * payload.element_size(), seconds + time.perf_counter() - t0))
    return blocks
