"""The communicator: every message between ranks goes through here, and is counted.

A `Communicator` is one rank's end of a torch.distributed process group. It
offers exactly the operations nanoserve needs, each named after the
collective it is:

    all_reduce(t)           every rank ends with the sum of everyone's t (row-parallel layers,
                            the vocab-parallel embedding)
    gather_to_driver(t)     rank 0 gets everyone's t, in rank order (vocab-parallel logits)
    broadcast_object(obj)   rank 0's Python object, pickled, reaches every rank (each step's batch)
    gather_objects(obj)     rank 0 gets every rank's object (per-rank pool reports, invariant checks)
    send / recv             one rank to another (the KV blocks of prefill/decode disaggregation)

and records, per kind, how many calls, how many payload bytes this rank put
in, and the wall time it spent inside them (which includes waiting for the
slowest rank: that *is* the cost of a collective). `take_stats()` hands the
counts over and starts afresh; the driver turns them into `CollectiveOps`
events once per step.

Bytes are the payload this rank contributes (an all-reduce of a [T, hidden]
float32 tensor counts T * hidden * 4), not what travels on the wire: a ring
all-reduce moves about 2 (N - 1) / N times that per rank.

The process group is a `ProcessGroupGloo` object built directly (not
torch's global default group), so one process can hold several groups at
once: a tensor-parallel engine and a disaggregated pair side by side.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class OpStats:
    """Calls of one kind since the last `take_stats()`."""

    count: int = 0
    num_bytes: int = 0        # payload this rank contributed
    seconds: float = 0.0      # wall time inside the calls


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator:
    def __init__(self, pg, rank: int, world_size: int) -> None:
        self.pg = pg                  # a torch.distributed ProcessGroupGloo (a "Backend" object)
        self.rank = rank
        self.world_size = world_size
        self.stats: dict[str, OpStats] = {}

    def _record(self, kind: str, num_bytes: int, t0: float) -> None:
        s = self.stats.setdefault(kind, OpStats())
        s.count += 1
        s.num_bytes += num_bytes
        s.seconds += time.perf_counter() - t0

    def take_stats(self) -> dict[str, OpStats]:
        """The counts since the last call, by kind; counting starts afresh."""
        stats, self.stats = self.stats, {}
        return stats

    # -- tensors ------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks, in place. Half precision is summed in float32 (gloo's sums are
        float32 anyway on a CPU, and the partial sums of a row-parallel layer deserve it)."""
        t0 = time.perf_counter()
        work = t if t.dtype == torch.float32 else t.float()
        self.pg.allreduce(work).wait()
        if work is not t:
            t.copy_(work)
        self._record("all_reduce", nbytes(t), t0)
        return t

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets [t of rank 0, t of rank 1, ...] (same shapes everywhere); others get None."""
        t0 = time.perf_counter()
        t = t.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self.pg.gather(parts, t, 0).wait()
        else:
            parts = None
            self.pg.gather([], t, 0).wait()
        self._record("gather", nbytes(t), t0)
        return parts

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        t0 = time.perf_counter()
        self.pg.send([t.contiguous()], dst, tag).wait()
        self._record("send", nbytes(t), t0)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into `t` (its shape and dtype must be the sender's)."""
        t0 = time.perf_counter()
        self.pg.recv([t], src, tag).wait()
        self._record("recv", nbytes(t), t0)
        return t

    # -- Python objects (pickled into uint8 tensors: a length, then the bytes) -------------

    def broadcast_object(self, obj=None):
        """Rank 0 passes `obj`; every rank returns it."""
        t0 = time.perf_counter()
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.broadcast(data, 0).wait()
        self._record("broadcast", data.numel() + 8, t0)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def gather_objects(self, obj) -> list | None:
        """Rank 0 gets [obj of rank 0, obj of rank 1, ...]; others get None."""
        t0 = time.perf_counter()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        # A gather moves same-sized tensors: every rank pads to the longest payload, after
        # an 8-byte length so rank 0 knows where each one ends.
        width = torch.tensor([data.numel()], dtype=torch.int64)
        self.pg.allreduce(width, op=torch.distributed.ReduceOp.MAX).wait()
        buf = torch.zeros(8 + int(width), dtype=torch.uint8)
        buf[:8] = size.view(torch.uint8)
        buf[8 : 8 + data.numel()] = data
        parts = self._gather_raw(buf)
        self._record("gather_object", data.numel() + 8, t0)
        if parts is None:
            return None
        return [pickle.loads(p[8 : 8 + int(p[:8].view(torch.int64))].numpy().tobytes()) for p in parts]

    def send_object(self, obj, dst: int) -> None:
        t0 = time.perf_counter()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 1).wait()
        self.pg.send([data], dst, 2).wait()
        self._record("send", data.numel() + 8, t0)

    def recv_object(self, src: int):
        t0 = time.perf_counter()
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([size], src, 1).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.recv([data], src, 2).wait()
        self._record("recv", data.numel() + 8, t0)
        return pickle.loads(data.numpy().tobytes())

    def _gather_raw(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """gather_to_driver without counting (it is part of gather_objects)."""
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self.pg.gather(parts, t, 0).wait()
            return parts
        self.pg.gather([], t, 0).wait()
        return None
