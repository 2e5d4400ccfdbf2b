"""The driver's side of tensor parallelism: a runner the engine uses like its ModelRunner.

    engine = LLMEngine(EngineConfig(model="tiny-llama", tensor_parallel_size=2))

The engine keeps everything it always had (scheduler, block pool, prefix
cache, sampler) in the driver process; only its runner changes. The
`TensorParallelRunner`

1. checks that N splits the model (FieldError naming `tensor_parallel_size`,
   before any process starts), then starts ranks 1..N-1 (group.py), or takes
   over an already started `WorkerGroup`;
2. splits the model (sharding.py) and sends each worker its own shard; rank 0,
   the driver itself, keeps shard 0 in a `RankRunner` (rank.py);
3. every step: the engine's block moves (swap out, swap in, copy-on-write
   copies) are applied to rank 0's pool at once and queued; `run()`
   broadcasts them with the step's inputs, so every rank applies the same
   moves to its own pool and builds the same block tables; then all ranks run
   the forward together (two all-reduces per layer, one for the embedding, a
   gather of the logits to rank 0), and each rank reports its pool;
4. turns the step's communication into `CollectiveOps` events and the ranks'
   reports into `RankPoolState` events;
5. `check_invariants` sends the driver's bookkeeping (every live block table,
   every cached node, with their tokens) to every rank, which compares it
   with its own ledger; the ledgers' digests must agree across ranks.

A worker that dies makes the next collective fail at once; the runner turns
that into a `WorkerDied` error (group.py) and the engine cannot go on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve import events as ev
from nanoserve.distributed.group import WorkerDied, WorkerGroup
from nanoserve.distributed.ledger import ExpectedKV
from nanoserve.distributed.messages import AllocateSwap, Check, Load, PoolSpec, RankReport, Step, Stop
from nanoserve.distributed.rank import RankRunner, worker_main
from nanoserve.distributed.sharding import check_shardable, shard_model
from nanoserve.implementation import Choice
from nanoserve.runner import Batch, RunInput


@dataclass(slots=True)
class TPBatch:
    """A step's inputs (what the workers get) and rank 0's own prepared batch."""

    inputs: list[RunInput]
    local: Batch


class TensorParallelRunner:
    def __init__(self, model: nn.Module, config, choice: Choice, emit: Callable[[ev.Event], None],
                 current_step: Callable[[], int], workers: WorkerGroup | None = None) -> None:
        n = config.tensor_parallel_size
        check_shardable(model, n)                        # a bad size fails before any process starts
        if not config.device.startswith("cpu"):
            from nanoserve.errors import FieldError
            raise FieldError("tensor_parallel_size", f"> 1 runs on device='cpu' (gloo) in this version, "
                                                     f"got device={config.device!r}")
        self.emit, self.current_step = emit, current_step
        self.owns_group = workers is None
        if workers is None:
            workers = start_workers(n)
        elif workers.world_size != n or not workers.alive or workers.owner is not None:
            raise ValueError(f"workers: a live, unused group of {n} ranks is needed, got {workers.world_size} "
                             f"ranks{'' if workers.alive else ' (shut down)'}"
                             f"{' serving another engine' if workers.owner is not None else ''}")
        self.group = workers
        self.group.owner = self
        self.spec = PoolSpec(config.num_blocks, config.block_size, config.dtype, config.device, choice.attention,
                             choice.path)
        shards = [shard_model(model, r, n) for r in range(n)]
        self.kv_heads = [s.kv_heads for s in shards]     # which of the model's KV heads each rank holds
        try:
            with self._guard():
                self.group.comm.broadcast_object(Load(self.spec))
                for r in range(1, n):
                    self.group.comm.send_object(shards[r], r)
                self.local = RankRunner(shards[0], self.spec, self.group.comm)
                self.group.comm.gather_objects("loaded")   # every rank has built its pool
        except BaseException:
            if self.owns_group:
                self.group.shutdown()
            raise
        self.comm = self.group.comm
        self.comm.take_stats()                           # loading is not a step's communication
        self.world_size = n
        self.block_size = config.block_size
        self.pending: list = []                          # block moves applied here, not yet sent to workers
        self.reports: list[RankReport] = []              # every rank's report after the last forward

    # -- the ModelRunner interface the engine uses ---------------------------------------------

    @property
    def implementation(self):
        """What computes rank 0's share of a step (every rank runs the same code on its own shard)."""
        return self.local.runner.implementation

    @property
    def kv_caches(self):
        """Rank 0's cache (its own KV heads only)."""
        return self.local.runner.kv_caches

    def allocate_swap(self, num_cpu_blocks: int) -> None:
        self.spec.num_cpu_blocks = num_cpu_blocks
        with self._guard():
            self.comm.broadcast_object(AllocateSwap(num_cpu_blocks))
            self.local.allocate_swap(num_cpu_blocks)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._move("swap_out", pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._move("swap_in", pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._move("copy", pairs)

    def _move(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        """Apply on rank 0 now; the workers get it with the next broadcast, before anything else."""
        if pairs:
            self._check_usable()
            self.local.move((kind, list(pairs)))
            self.pending.append((kind, list(pairs)))

    def prepare(self, inputs: list[RunInput]) -> TPBatch:
        return TPBatch(list(inputs), self.local.runner.prepare(inputs))

    def run(self, batch: TPBatch) -> torch.Tensor:
        """One forward on every rank; float32 logits [S, vocab] on the driver."""
        with self._guard():
            self.comm.broadcast_object(Step(self.pending, batch.inputs))
            self.pending = []
            logits = self.local.forward(batch.local)
            self.reports = self.comm.gather_objects(self.local.report())
        self._emit_step()
        return logits

    def flush(self) -> None:
        """Send queued block moves now (before a check, or when a step had moves but no forward)."""
        if self.pending:
            with self._guard():
                self.comm.broadcast_object(Step(self.pending, []))
                self.pending = []

    # -- events --------------------------------------------------------------------------------

    def _emit_step(self) -> None:
        step = self.current_step()
        for kind, s in sorted(self.comm.take_stats().items()):
            self.emit(ev.CollectiveOps(step, kind, s.count, s.num_bytes, s.seconds))
        for r in self.reports:
            self.emit(ev.RankPoolState(step, r.rank, r.kv_heads, r.bytes_per_block, r.num_blocks_written,
                                       r.num_blocks_copied, r.num_blocks_swapped, r.digest))

    def rank_info(self) -> list[dict]:
        """Per rank: which KV heads its pool holds and its share of a block (for snapshots)."""
        return [{"rank": r, "kv_heads": list(heads), "bytes_per_block": self.local.bytes_per_block}
                for r, heads in enumerate(self.kv_heads)]

    # -- invariants -------------------------------------------------------------------------------

    def check_invariants(self, scheduler, radix) -> None:
        """Every rank compares its pool with the driver's bookkeeping; AssertionError on any difference."""
        expected = expected_kv(scheduler, radix)
        self.flush()
        with self._guard():
            self.comm.broadcast_object(Check(expected))
            answers = self.comm.gather_objects((self.local.check(expected), self.local.ledger.digest()))
        self.comm.take_stats()          # checking is not part of any step's communication
        problems = [p for found, _ in answers for p in found]
        assert not problems, "per-rank KV pools disagree with the block tables:\n  " + "\n  ".join(problems[:10])
        digests = [d for _, d in answers]
        assert len(set(digests)) == 1, f"the ranks' slot ledgers differ: {digests}"

    # -- lifetime ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (or hand a borrowed group back, alive). Safe to call twice."""
        group, self.group = getattr(self, "group", None), None
        if group is None or group.owner is not self:
            return
        group.owner = None
        if self.owns_group:
            if group.alive:
                try:
                    group.comm.broadcast_object(Stop())
                except RuntimeError:
                    pass
            group.shutdown()

    def _check_usable(self) -> None:
        if self.group is None:
            raise WorkerDied("this engine was shut down: its worker processes are gone")
        if self.group.owner is not self:
            raise WorkerDied("this engine's worker group now serves another engine")
        self.group.check()

    def _guard(self):
        if getattr(self, "comm", None) is not None:      # (while loading, the group is fresh)
            self._check_usable()
        return self.group.guard()


def expected_kv(scheduler, radix) -> list[ExpectedKV]:
    """The driver's claims about every pool: what each live table and each cached node holds."""
    out = []
    for seq in scheduler.running:
        n = min(seq.num_computed_tokens, seq.num_tokens)
        out.append(ExpectedKV(seq.seq_id, list(seq.block_table), seq.token_ids(0, n)))
    for seq in scheduler.swapped:
        n = min(seq.num_computed_tokens, seq.num_tokens)
        out.append(ExpectedKV(seq.seq_id, list(seq.cpu_block_table), seq.token_ids(0, n), on_cpu=True))
    if radix is not None:
        for node in radix.nodes.values():
            if node is radix.root:
                continue
            depth = sum(len(n.tokens) for n in node.path()[1:])   # tokens above this node's span
            out.append(ExpectedKV(f"radix node {node.node_id}", list(node.block_ids), list(node.tokens), depth))
    return out


def start_workers(n: int) -> WorkerGroup:
    """Start ranks 1..n-1 of an n-way tensor-parallel engine, to hand to one engine after another
    (`LLMEngine(config, workers=group)`): the processes start once, each engine sends its shards."""
    return WorkerGroup.start(n, worker_main, what="tensor-parallel worker")


def stop_workers(group: WorkerGroup) -> None:
    """Tell the workers of `start_workers` to exit, then make sure they did."""
    if group.alive and group.owner is None:
        try:
            group.comm.broadcast_object(Stop())
        except RuntimeError:
            pass
    group.shutdown()
