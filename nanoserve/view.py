"""The view state: what every viewer draws.

This module owns the plain data types a viewer reads: `ViewState` (block
pool, block tables, queues, the radix tree, the CPU swap space, cache hit
counters, and across processes the ranks of tensor parallelism and the KV
handoffs of disaggregation), `SequenceView` (with its structured output's
`GrammarView`), `RadixNodeView`, `RankView` and `TransferView`, and the
questions viewers ask
of them (who holds a block, a node's lock count, which blocks are cached and
evictable). `fold.py` builds a ViewState from events; the TUI, the Graphviz
exporter and the lessons draw it, never the engine, so a recorded trace
replays without a model.

The bookkeeping mirrors the engine's:

* a block's ref count is the number of block tables holding it, plus one
  when a radix-tree node holds it (the tree takes one reference per block);
* the free queue holds the blocks with ref count 0, head (next allocated)
  first; freed blocks join the tail;
* a node's lock count is not stored: it is the number of live sequences whose
  deepest held node (`SequenceView.cache_node`) is that node or one below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.events import StepFinished
from nanoserve.kv_usage import KVUsage, hit_rate, kv_usage

FINISHED_STATUS = {"stop": "finished_stopped", "length": "finished_length", "abort": "finished_aborted",
                   "pruned": "finished_pruned"}
HISTORY_LEN = 1000  # finished steps kept in ViewState.history
ROOT = 0            # the radix tree's root: no blocks, never drawn as a span


@dataclass(slots=True)
class GrammarView:
    """A structured-output sequence's grammar, as its TokenConstrained events tell it."""

    kind: str = "?"                   # "json", "regex", "choice", "grammar", "json_object" ("?": not seen)
    vocab_size: int = 0
    num_allowed: int = 0              # tokens the mask allowed at the last position
    num_tokens: int = 0               # tokens sampled under the grammar
    num_forced: int = 0               # ... of which the mask allowed exactly one
    num_top_masked: int = 0           # ... of which the model's own top choice was forbidden
    allowed: list[int] = field(default_factory=list)   # num_allowed per token, the last HISTORY_LEN

    def summary(self) -> str:
        """"grammar json: 3 of 49,152 allowed · forced 5 of 12" (before any token: the kind only)."""
        if not self.num_tokens:
            return f"grammar {self.kind}: no token yet"
        return (f"grammar {self.kind}: {self.num_allowed:,} of {self.vocab_size:,} allowed · "
                f"forced {self.num_forced} of {self.num_tokens}")


@dataclass(slots=True)
class SequenceView:
    """One sequence as a viewer sees it."""

    seq_id: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    status: str = "waiting"           # "waiting" | "running" | "swapped" | "finished_" + stopped/length/aborted/pruned
    output_text: str = ""
    num_output_tokens: int = 0
    num_computed_tokens: int = 0      # tokens whose KV is in the cache (on the device, or on the CPU when swapped)
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "pruned" once finished
    cache_node: int = ROOT            # the deepest radix node this sequence holds (0: none)
    cpu_block_table: list[int] = field(default_factory=list)   # CPU pool blocks while swapped out
    grammar: GrammarView | None = None   # structured output (None: free text)
    # KV cache groups 1.. (kv_groups.py; empty with one group): each group's table, indexed as block_table,
    # -1 where the block left the group's window; and their CPU copies while swapped
    group_tables: list[list[int]] = field(default_factory=list)
    cpu_group_tables: list[list[int]] = field(default_factory=list)

    def locate(self, block_id: int) -> tuple[int, int]:
        """(KV cache group, index in its table) of a block this sequence holds: (0, i) with one group."""
        for g, table in enumerate([self.block_table, *self.group_tables]):
            if block_id in table:
                return g, table.index(block_id)
        raise ValueError(f"{self.seq_id} does not hold block {block_id}")


@dataclass(slots=True)
class RadixNodeView:
    """One node of the radix prefix tree: a span of whole blocks under its parent."""

    node_id: int
    parent_id: int                    # -1 for the root
    text: str                         # the span's tokens as text
    num_tokens: int
    block_ids: list[int]              # the tree holds one reference on each
    last_access: int = 0              # the step it was last matched or extended
    children: list[int] = field(default_factory=list)   # node ids, in creation order (= id order)


@dataclass(slots=True)
class RankView:
    """One rank of a tensor-parallel engine: its KV heads, and what it did to its pool last step."""

    rank: int
    kv_heads: tuple[int, ...]         # the model's KV heads this rank's pool holds
    bytes_per_block: int              # its share of one block
    num_blocks_written: int = 0
    num_blocks_copied: int = 0
    num_blocks_swapped: int = 0
    digest: str = ""                  # its slot ledger's hash (equal on every rank)


@dataclass(slots=True)
class TransferView:
    """One KV handoff into this engine's pool (prefill/decode disaggregation)."""

    step: int
    request_id: str
    src: str
    dst: str
    src_block_ids: list[int]
    block_ids: list[int]
    num_tokens: int
    num_bytes: int


def _root() -> dict[int, RadixNodeView]:
    return {ROOT: RadixNodeView(ROOT, -1, "", 0, [])}


@dataclass(slots=True)
class ViewState:
    """Everything a viewer draws, rebuilt from events by `fold`."""

    step: int
    model: str
    num_blocks: int
    block_size: int
    ref_counts: list[int]             # per physical block
    free_queue: list[int]             # block ids, head (next allocated) first
    sequences: dict[str, SequenceView] = field(default_factory=dict)  # in arrival order, finished kept
    waiting: list[str] = field(default_factory=list)    # sequence ids, next admitted first
    running: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)   # in finishing order
    touched_blocks: set[int] = field(default_factory=set)  # allocated, freed, copied or shared this step
    last_step: StepFinished | None = None
    # (step, num_prefill_tokens, num_decode_tokens, num_free_blocks, duration_s), last HISTORY_LEN steps
    history: list[tuple[int, int, int, int, float]] = field(default_factory=list)
    # -- memory mechanisms --
    prefix_caching: bool = False      # the engine keeps a radix prefix cache
    radix: dict[int, RadixNodeView] = field(default_factory=_root)   # node id -> node, the root (0) included
    swapped: list[str] = field(default_factory=list)    # sequences whose KV sits in the CPU pool
    num_cpu_blocks: int = 0           # size of the CPU swap pool (0: no swapping)
    # since the engine started: EngineSynced's counts, plus PrefixMatched's num_hit_tokens / num_tokens
    cache_hit_tokens: int = 0
    cache_lookup_tokens: int = 0
    # (step, cache_hit_tokens, cache_lookup_tokens) after each step, last HISTORY_LEN steps
    cache_history: list[tuple[int, int, int]] = field(default_factory=list)
    # (step, used, cached) blocks after each step (kv_usage.py's words), last HISTORY_LEN steps
    kv_history: list[tuple[int, int, int]] = field(default_factory=list)
    hit_nodes: set[int] = field(default_factory=set)        # matched this step
    inserted_nodes: set[int] = field(default_factory=set)   # created this step
    evicted_nodes: dict[int, RadixNodeView] = field(default_factory=dict)   # removed this step (kept to draw)
    # -- across processes (distributed/) --
    ranks: list[RankView] = field(default_factory=list)     # tensor parallelism: one per rank (empty: one process)
    collectives: list[tuple[str, int, int, float]] = field(default_factory=list)   # (kind, count, bytes, s) this step
    transfers: list[TransferView] = field(default_factory=list)   # KV handoffs received, the last HISTORY_LEN
    # What computes the steps (runner.Implementation as a dict: path, model, attention, matmul, note)
    implementation: dict[str, str] = field(default_factory=dict)
    # -- KV cache groups (kv_groups.py) --
    kv_groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)   # (window or 0, layers); [] = one
    companions: dict[int, list[int]] = field(default_factory=dict)   # cached group-0 block -> groups 1..'s blocks
    left_window: set[int] = field(default_factory=set)    # blocks that left a window this step (drawn so)

    def implementation_line(self) -> str:
        """What computes the steps, short for a header (see `implementation_line`)."""
        return implementation_line(self.implementation)


    def block_owners(self) -> dict[int, list[str]]:
        """Block id -> ids of the sequences whose block tables hold it (held blocks only)."""
        owners: dict[int, list[str]] = {}
        for rid, req in self.sequences.items():
            for block_id in [*req.block_table, *(b for t in req.group_tables for b in t if b >= 0)]:
                if block_id in owners:
                    owners[block_id].append(rid)
                else:
                    owners[block_id] = [rid]
        return owners

    # -- the radix tree --
    def radix_nodes(self) -> list[RadixNodeView]:
        """Every node but the root, parents before children (depth first, children in order)."""
        out, stack = [], list(reversed(self.radix[ROOT].children))
        while stack:
            node = self.radix[stack.pop()]
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def radix_path(self, node_id: int) -> list[int]:
        """Node ids from just under the root down to `node_id` (empty for the root or an unknown node)."""
        path = []
        while node_id != ROOT and node_id in self.radix:
            path.append(node_id)
            node_id = self.radix[node_id].parent_id
        return path[::-1]

    def lock_counts(self) -> dict[int, int]:
        """Node id -> how many live sequences hold it or a node below it (every node but the root)."""
        counts = {node_id: 0 for node_id in self.radix if node_id != ROOT}
        for req in self.sequences.values():
            if not req.status.startswith("finished"):
                for node_id in self.radix_path(req.cache_node):
                    counts[node_id] += 1
        return counts

    def cached_blocks(self) -> dict[int, int]:
        """Block id -> the radix node holding it."""
        return {c: node.node_id for node in self.radix.values() for b in node.block_ids
                for c in (b, *self.companions.get(b, ())) if c >= 0}   # (KV cache groups: its companions too)

    def evictable_blocks(self) -> set[int]:
        """Blocks only the cache holds (ref count 1, node unlocked): reusable by a hit, or evicted for room."""
        locks = self.lock_counts()
        alone = {c for cs in self.companions.values() for c in cs}   # (group_cache.py: evictable when unheld)
        return {b for b, node_id in self.cached_blocks().items()
                if self.ref_counts[b] == 1 and (locks[node_id] == 0 or b in alone)}

    def block_kinds(self, owners: dict[int, list[str]] | None = None) -> list[str]:
        """Per block, what a picture colours it by:

        "free" (ref 0), "owned" (one sequence's table holds it, maybe the cache too),
        "shared" (two or more tables), "cached" (only the cache: evictable), "held" (by no
        sequence we know, e.g. a locked node with its sequences out of view).
        """
        owners = self.block_owners() if owners is None else owners
        evictable = self.evictable_blocks() if self.prefix_caching else set()
        # Most blocks are free or held by one sequence: start from the ref counts, then fix up.
        kinds = ["free" if ref == 0 else "held" for ref in self.ref_counts]
        for block_id, holders in owners.items():
            kinds[block_id] = "shared" if len(holders) > 1 else "owned"
        for block_id in evictable:
            if kinds[block_id] == "held":
                kinds[block_id] = "cached"
        return kinds

    def kv_usage(self) -> KVUsage:
        """The pool as used / cached / free blocks, counted as /metrics counts them (kv_usage.py)."""
        cached = len(self.evictable_blocks()) if self.prefix_caching else 0
        return kv_usage(self.num_blocks, len(self.free_queue), cached)

    def cache_hit_rate(self) -> float | None:
        """Prompt tokens whose KV came from the cache / tokens looked up, since the engine started
        (kv_usage.HIT_RATE); None before any lookup."""
        return hit_rate(self.cache_hit_tokens, self.cache_lookup_tokens)

    def cpu_blocks_used(self) -> int:
        return sum(len(req.cpu_block_table) + sum(b >= 0 for t in req.cpu_group_tables for b in t)
                   for req in self.sequences.values())


def implementation_line(impl: dict[str, str]) -> str:
    """runner.Implementation as a dict -> "fast path: CpuLlama · attention cpu · matmul panels" ("" if unknown)."""
    if not impl:
        return ""
    short = lambda s: s.split(" (")[0]   # noqa: E731 -- "CpuLlama (cpu/llama.py)" -> "CpuLlama"
    line = f"{impl.get('path', '?')} path: {short(impl.get('model', '?'))} · attention " \
           f"{short(impl.get('attention', '?'))} · matmul {short(impl.get('matmul', '?'))}"
    return line + (" (fell back: " + impl["note"] + ")" if impl.get("note") else "")
