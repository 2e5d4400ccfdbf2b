"""CUDA graphs for pure-decode steps: captured once per batch-size bucket at start-up, replayed with one call.

On a GPU a small model's decode step is bound by the CPU: every layer launches a
dozen kernels, each costing a few microseconds of Python and driver work, and
the GPU finishes each about as fast. A CUDA graph records a whole forward's
launches once; replaying it is one call. A graph fixes every kernel's grid and
every tensor's address and shape, so a step that replays one must look exactly
like the step that was captured:

    buckets         batch sizes captured at start-up: 1, 2, 4, 8, then every 8 up to max_num_seqs
    bucket_for(n)   a step of n decodes runs the smallest bucket >= n; rows n .. bucket-1 are
                    padding: token 0 at position 0 with one token of context, its K/V written to
                    and read from a scratch block after the pool's last (the pool never hands it out)
    table width     every block table padded to ceil(max_model_len / block_size) blocks, with the
                    scratch block: one width for every step (kernels read a row up to its length only)
    static buffers  input ids, positions and every tensor of the attention metadata, one set per
                    bucket; a step's values are copied into them, then the graph replays

Only pure-decode steps take this path: every input one token with its logits
wanted (a prompt's last one-token chunk is no different); a step with a longer
prefill chunk, or drafts to verify, runs eagerly.
`EngineConfig(enforce_eager=True)` turns graphs off. A CPU has no graphs, but
`enforce_eager=False` runs this same padded static-buffer path there without
capturing it, so the CPU tests check all of the bookkeeping and a GPU only
confirms the capture. Outputs do not change: a row's result does not depend on
the rows beside it or on its table's padded width (the decode kernel's splits
are a fixed length, kernels/triton_decode.py).

The runner (runner.py) asks `prepare(inputs)` for a padded batch (None: run
eagerly) and `run(batch)` for its logits; it owns the model, the cache and the
attention backend, which this module uses as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch

from nanoserve.attention import AttentionMetadata, BatchLayout


@dataclass(frozen=True, slots=True)
class GraphSettings:
    """What the runner needs to know to pad and capture (from EngineConfig)."""
    max_num_seqs: int          # the largest bucket covers it
    max_model_len: int         # sets the block tables' width
    capture: bool              # True on CUDA; False runs the padded static path eagerly (a CPU, the tests)

    @staticmethod
    def from_config(config) -> GraphSettings | None:
        """None when graphs are off: enforce_eager=True, or None (the default) on a CPU, or tensor parallelism."""
        cuda = config.device.startswith("cuda")
        if config.enforce_eager or (config.enforce_eager is None and not cuda) or config.tensor_parallel_size > 1:
            return None
        return GraphSettings(config.max_num_seqs, config.max_model_len, capture=cuda)


def buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ...: the batch sizes to capture; the last is the first one >= max_num_seqs."""
    candidates = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return (*[b for b in candidates if b < max_num_seqs], next(b for b in candidates if b >= max_num_seqs))


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds n rows (None: more rows than the largest)."""
    return next((b for b in sizes if b >= n), None)


@dataclass(slots=True)
class GraphBatch:
    """A pure-decode step padded to its bucket; rows 0 .. num_rows-1 are the real inputs, in their order."""
    bucket: int
    num_rows: int
    input_ids: torch.Tensor        # [bucket] int64
    positions: torch.Tensor        # [bucket] int64
    meta: AttentionMetadata        # the backend's, built from the padded layout


@dataclass(slots=True)
class _Static:
    """One bucket's buffers: the graph reads these addresses, so a step's values are copied in."""
    batch: GraphBatch
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None      # [bucket, vocab] float32: the graph's output


def copy_into(static, fresh, where: str = "meta") -> None:
    """Copy every tensor of `fresh` into the same place in `static` (dataclasses, lists, tensors).

    A bucket's metadata always has the same structure; anything else that differs would be baked
    into the graph with its old value, so it is an error."""
    if isinstance(static, torch.Tensor):
        if static.shape != fresh.shape or static.dtype != fresh.dtype:
            raise ValueError(f"{where}: {tuple(fresh.shape)} {fresh.dtype}, captured as "
                             f"{tuple(static.shape)} {static.dtype}")
        static.copy_(fresh, non_blocking=True)
    elif isinstance(static, (list, tuple)) and len(static) == len(fresh):
        for i, (a, b) in enumerate(zip(static, fresh)):
            copy_into(a, b, f"{where}[{i}]")
    elif is_dataclass(static) and type(static) is type(fresh):
        for f in fields(static):
            copy_into(getattr(static, f.name), getattr(fresh, f.name), f"{where}.{f.name}")
    elif static is not fresh and static != fresh:
        raise ValueError(f"{where} is {fresh!r} in this step, {static!r} in the captured one")


class DecodeGraphs:
    """The padded path of one runner: bucket choice, padding, static buffers, capture and replay."""

    def __init__(self, runner, settings: GraphSettings, pad_block: int) -> None:
        self.runner = runner                       # its model, kv_caches, attention backend, device
        self.settings = settings
        self.buckets = buckets(settings.max_num_seqs)
        self.width = -(-settings.max_model_len // runner.block_size)   # blocks in every padded table
        self.pad_block = pad_block                 # the scratch block padding rows write to
        self.static: dict[int, _Static] = {}
        self._pool = None                          # the graphs' shared memory pool

    def prepare(self, inputs) -> GraphBatch | None:
        """A pure-decode step's inputs (runner.RunInput) padded to their bucket; None for any other step."""
        bucket = bucket_for(len(inputs), self.buckets)
        bs = self.runner.block_size
        if not inputs or bucket is None or any(len(x.token_ids) != 1 or x.num_logits != 1
                                               or x.start >= self.width * bs for x in inputs):
            return None
        return self._padded([(x.token_ids[0], x.start, x.block_table) for x in inputs], bucket)

    def _padded(self, rows: list[tuple[int, int, list[int]]], bucket: int) -> GraphBatch:
        """(token, position, block table) per real row, plus padding rows up to `bucket`."""
        bs, n = self.runner.block_size, len(rows)
        rows = rows + [(0, 0, [self.pad_block])] * (bucket - n)
        lens = [pos + 1 for _, pos, _ in rows]                   # context of each row, its new token included
        tables = [table[: -(-length // bs)] for (_, _, table), length in zip(rows, lens)]
        tables = [t + [self.pad_block] * (self.width - len(t)) for t in tables]
        slots = [table[pos // bs] * bs + pos % bs for _, pos, table in rows]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.runner.device)  # noqa: E731
        layout = BatchLayout(bs, as_tensor(slots), lens, tables)
        return GraphBatch(bucket, n, as_tensor([t for t, _, _ in rows]), as_tensor([p for _, p, _ in rows]),
                          self.runner.attn.prepare(layout))

    def _forward(self, batch: GraphBatch) -> torch.Tensor:
        model = self.runner.model
        hidden = model(batch.input_ids, batch.positions, self.runner.kv_caches, batch.meta)    # [bucket, hidden]
        return model.compute_logits(hidden).float()                                            # [bucket, vocab]

    @torch.inference_mode()
    def run(self, batch: GraphBatch) -> torch.Tensor:
        """Logits [num_rows, vocab]: the bucket's graph replayed on this step's values (or, uncaptured, the
        same static buffers run eagerly; a bucket's first batch becomes its buffers)."""
        static = self.static.get(batch.bucket)
        if static is None:
            static = self.static[batch.bucket] = _Static(batch)
        else:
            copy_into(static.batch.input_ids, batch.input_ids, "input_ids")
            copy_into(static.batch.positions, batch.positions, "positions")
            copy_into(static.batch.meta, batch.meta)
        if static.graph is None:
            return self._forward(static.batch)[: batch.num_rows]
        static.graph.replay()
        return static.logits[: batch.num_rows].clone()     # the next replay overwrites the graph's output

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its memory pool), on padding rows only."""
        for bucket in sorted(self.buckets, reverse=True):
            static = self.static[bucket] = _Static(self._padded([], bucket))
            side = torch.cuda.Stream()                  # warm up off the capture stream (Triton compiles here)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(static.batch)
            torch.cuda.current_stream().wait_stream(side)
            static.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(static.graph, pool=self._pool):
                static.logits = self._forward(static.batch)
            self._pool = static.graph.pool()
        torch.cuda.synchronize()
