"""What the driver tells tensor-parallel workers, and what they report back: plain, picklable data.

Every call starts with one `broadcast_object` from the driver (rank 0), and
every rank, driver included, then does the same thing:

    Load        a new shard follows, point to point (each rank gets only its own), with the
                pool's shape: build a ModelRunner over it (a group may serve several engines,
                one after another)
    Step        apply these block moves (swap out, swap in, copy-on-write copies, in the
                engine's order), then run one forward over these inputs (the collectives
                inside it keep the ranks in lock step), then report the pool
    Check       compare the ledger with the driver's bookkeeping; gather the problems
    AllocateSwap  a CPU swap space of this many blocks
    Stop        leave the loop and exit

The inputs are `RunInput`s (tokens, start position, block table): each rank
builds its own tensors from them with its own `ModelRunner.prepare`, so the
same block tables reach every rank's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.distributed.ledger import ExpectedKV
from nanoserve.runner import RunInput

# A block move as the engine hands it to its runner: ("swap_out" | "swap_in" | "copy", [(src, dst), ...])
Move = tuple[str, list[tuple[int, int]]]


@dataclass(slots=True)
class PoolSpec:
    """The shape of every rank's pool and how it runs its forward."""

    num_blocks: int
    block_size: int
    dtype: str                    # "float32", "bfloat16", "float16"
    device: str
    attention: str                # attention backend: "torch", "triton" or "cpu" (implementation.choose)
    path: str                     # "fast", "torch" or "reading" (EngineConfig.path)
    num_cpu_blocks: int = 0


@dataclass(slots=True)
class Load:
    spec: PoolSpec                # the shard itself follows with send_object, one per rank


@dataclass(slots=True)
class Step:
    moves: list[Move] = field(default_factory=list)
    inputs: list[RunInput] = field(default_factory=list)   # empty: only the moves


@dataclass(slots=True)
class Check:
    expected: list[ExpectedKV]


@dataclass(slots=True)
class AllocateSwap:
    num_cpu_blocks: int


@dataclass(slots=True)
class Stop:
    pass


@dataclass(slots=True)
class RankReport:
    """One rank's pool after a step, in its own words (becomes a RankPoolState event)."""

    rank: int
    kv_heads: tuple[int, ...]         # the model's KV heads this rank's cache holds
    bytes_per_block: int              # this rank's share of one block: all layers, K and V
    num_blocks_written: int = 0       # blocks the forward wrote K/V into
    num_blocks_copied: int = 0        # copy-on-write copies
    num_blocks_swapped: int = 0       # blocks swapped out or in
    digest: str = ""                  # the slot ledger's hash (equal on every rank)
