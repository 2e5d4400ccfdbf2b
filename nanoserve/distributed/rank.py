"""One rank's share of a tensor-parallel engine: its shard, its KV pool, its ledger. Runs on every rank.

The driver's rank 0 and every worker hold a `RankRunner`:

    runner   an ordinary `ModelRunner` over this rank's shard of the model, so
             the pool is [num_blocks, block_size, Hkv / N, head_dim] per layer:
             the same blocks as every other rank, holding only this rank's KV heads
    ledger   which (token, position) each slot holds (ledger.py), moved with the KV

`execute(Step)` applies the step's block moves in order, then one forward;
the all-reduces and the gather inside the shard's layers are what keep the
ranks in lock step. `report()` says what this rank did to its pool since the
last report; `check(expected)` compares its pool with the driver's
bookkeeping. `worker_main` is the loop a worker process runs.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed.layers import attach
from nanoserve.distributed.ledger import ExpectedKV, SlotLedger
from nanoserve.distributed.messages import AllocateSwap, Check, Load, Move, PoolSpec, RankReport, Step, Stop
from nanoserve.implementation import Choice
from nanoserve.runner import Batch, ModelRunner, kv_bytes_per_block


class RankRunner:
    def __init__(self, shard: nn.Module, spec: PoolSpec, comm) -> None:
        attach(shard, comm)                 # before the runner makes its CPU view of the model
        dtype = getattr(torch, spec.dtype)
        self.spec = spec
        self.rank = comm.rank
        self.kv_heads: tuple[int, ...] = shard.kv_heads
        self.runner = ModelRunner(shard, spec.num_blocks, spec.block_size, dtype, torch.device(spec.device),
                                  Choice(spec.path, spec.attention))
        self.ledger = SlotLedger(spec.num_blocks, spec.block_size)
        self.bytes_per_block = kv_bytes_per_block(shard, spec.block_size, dtype)
        self.allocate_swap(spec.num_cpu_blocks)
        self._counts = {"written": 0, "copied": 0, "swapped": 0}

    def allocate_swap(self, num_cpu_blocks: int) -> None:
        if num_cpu_blocks:
            self.runner.allocate_swap(num_cpu_blocks)
            self.ledger.allocate_swap(num_cpu_blocks)

    # -- the work ------------------------------------------------------------------------

    def move(self, move: Move) -> None:
        """One block move on this rank's KV and its ledger."""
        kind, pairs = move
        if kind == "swap_out":
            self.runner.swap_out(pairs)
            self.ledger.swap_out(pairs)
        elif kind == "swap_in":
            self.runner.swap_in(pairs)
            self.ledger.swap_in(pairs)
        elif kind == "copy":
            self.runner.copy_blocks(pairs)
            self.ledger.copy(pairs)
        else:
            raise ValueError(f"unknown block move {kind!r}")
        self._counts["copied" if kind == "copy" else "swapped"] += len(pairs)

    def forward(self, batch: Batch) -> torch.Tensor:
        """One forward over a prepared batch (collectives inside); logits on rank 0, a slice elsewhere."""
        written = self.ledger.write(batch.meta.slot_mapping, batch.input_ids, batch.positions)
        self._counts["written"] += len(written)
        return self.runner.run(batch)

    def execute(self, step: Step) -> torch.Tensor | None:
        for move in step.moves:
            self.move(move)
        return self.forward(self.runner.prepare(step.inputs)) if step.inputs else None

    # -- saying how it went --------------------------------------------------------------------

    def report(self) -> RankReport:
        """What this rank did to its pool since the last report."""
        c, self._counts = self._counts, {"written": 0, "copied": 0, "swapped": 0}
        return RankReport(self.rank, self.kv_heads, self.bytes_per_block, c["written"], c["copied"], c["swapped"],
                          self.ledger.digest())

    def check(self, expected: list[ExpectedKV]) -> list[str]:
        """Problems with this rank's pool: its shape, and every slot that disagrees with the driver."""
        problems = []
        k, v = self.runner.kv_caches[0]
        want = (self.spec.num_blocks, self.spec.block_size, len(self.kv_heads))
        if tuple(k.shape[:3]) != want or k.shape != v.shape:
            problems.append(f"cache shape {tuple(k.shape)}, expected {want} + (head_dim,)")
        problems += self.ledger.check(expected)
        return [f"rank {self.rank}: {p}" for p in problems]


def worker_main(comm) -> None:
    """A worker's loop: one broadcast from the driver per call, then the same work as rank 0."""
    rank = None
    while True:
        msg = comm.broadcast_object()
        if isinstance(msg, Load):
            shard = comm.recv_object(0)                 # only this rank's shard travels to it
            rank = RankRunner(shard, msg.spec, comm)
            comm.gather_objects("loaded")               # the driver waits until every rank is ready
        elif isinstance(msg, Step):
            rank.execute(msg)
            if msg.inputs:
                comm.gather_objects(rank.report())
        elif isinstance(msg, Check):
            comm.gather_objects((rank.check(msg.expected), rank.ledger.digest()))
        elif isinstance(msg, AllocateSwap):
            rank.allocate_swap(msg.num_cpu_blocks)
        elif isinstance(msg, Stop):
            return
        comm.take_stats()                               # workers do not report counts; keep them small
