"""Events: what the engine decided, as small frozen plain-data records.

Every decision the engine makes (admit a sequence, schedule a chunk, allocate
or free blocks, preempt, sample a token, finish) is published as one of these.
They hold only ints, floats, strings, bools and tuples, never tensors or live
objects, so a trace can be written to JSONL and replayed without a model.
Each carries `step`: the step it happened in (events between steps, like
`add_request`, carry the number of the last finished step, 0 at the start).

Viewers (TUI, Graphviz, REPL, lessons) are built on these and on `fold()` in
`fold.py` (re-exported by `trace.py`), never on engine internals.
"""

from __future__ import annotations

from dataclasses import dataclass


class StepClock:
    """The engine's step number: one object, advanced by the engine only at the start of each step.

    The scheduler, the KV manager and the radix cache hold the same clock and read
    `clock.step` to stamp their events (and the cache its `last_access`), so there is
    one step number, never a copy that could fall behind.
    """

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step = 0


# The trace format's version: 2 added KV cache groups (EngineSynced's kv_groups, group_tables and
# companions; the block events' group fields; BlocksLeftWindow, GroupsCached). Version 1 traces have
# none of them, and read as one group.
TRACE_VERSION = 2


@dataclass(frozen=True, slots=True)
class Event:
    """Base of all events: the step number."""

    step: int


@dataclass(frozen=True, slots=True)
class EngineSynced(Event):
    """The whole engine state, sent to a new subscriber so it can start mid-run."""

    model: str
    num_blocks: int
    block_size: int
    ref_counts: tuple[int, ...]       # per physical block
    free_queue: tuple[int, ...]       # block ids, head (next allocated) first
    # (seq_id, status, prompt, num_prompt_tokens, output_text, num_output_tokens,
    #  num_computed_tokens, block_table, max_tokens, cache_node, cpu_block_table, grammar) per live
    #  sequence, waiting and swapped ones included; grammar is structured output's kind or "" (older
    #  traces have only the first 9 or 11 fields)
    sequences: tuple[tuple, ...]
    # Radix prefix cache: (node_id, parent_id, text, num_tokens, block_ids, last_access) per node,
    # parents before children, the root (node 0) left out. Empty when prefix caching is off.
    radix: tuple[tuple, ...] = ()
    prefix_caching: bool = False
    num_cpu_blocks: int = 0            # swap space: blocks of the CPU pool (0: no swapping)
    # Tensor parallelism: (rank, kv_heads, bytes_per_block) per rank; empty for one process
    ranks: tuple[tuple, ...] = ()
    # The engine's settings as (EngineConfig field, value) pairs, so a trace says what ran it
    # (empty in traces recorded before they were added).
    config: tuple[tuple[str, object], ...] = ()
    # What computed the steps, as (field, value) pairs of runner.Implementation: the path ("fast" or
    # "reading"), model class, attention backend, matmul and a note (empty in older traces).
    implementation: tuple[tuple[str, str], ...] = ()
    # The prefix cache's counts since the engine started (kv_usage.HIT_RATE), so a viewer that joins
    # mid-run shows the hit rate /metrics shows (0 in traces recorded before they were added).
    cache_hit_tokens: int = 0
    cache_lookup_tokens: int = 0
    # KV cache groups (kv_groups.py; empty for one group): (window or 0, layers) per group, group 0 first;
    # (seq_id, group_tables, cpu_group_tables) per live sequence that has them (FREED entries are -1);
    # (group 0's cached block, its companions in groups 1..) per cached block the tree holds them for
    kv_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    group_tables: tuple[tuple, ...] = ()
    companions: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # The trace format (TRACE_VERSION when recorded; 1: before the format had a number). A reader
    # refuses a trace newer than itself and reads every older one.
    trace_version: int = 1


@dataclass(frozen=True, slots=True)
class StepStarted(Event):
    """A step begins: how many sequences wait and run before scheduling."""

    num_waiting: int
    num_running: int


@dataclass(frozen=True, slots=True)
class RequestAdded(Event):
    """A request entered the waiting queue, as its first sequence (whose `seq_id` is the request's id).

    The last three fields make the call repeatable (nanoserve/whatif replays them): older
    traces lack them and still fold."""

    request_id: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    token_ids: tuple[int, ...] = ()   # the prompt as given in token ids (empty: it was the text `prompt`)
    # SamplingParams as (field, value) pairs: the fields set away from their defaults, and always
    # the seed the request's RNG got (its own, or one drawn from the engine's RNG)
    params: tuple[tuple[str, object], ...] = ()
    priority: int = 0

    @property
    def seq_id(self) -> str:
        """The id of the request's first sequence: the request's own."""
        return self.request_id


@dataclass(frozen=True, slots=True)
class SequenceAdmitted(Event):
    """A waiting sequence got its first blocks and joined the running batch (a preempted one: again)."""

    seq_id: str


@dataclass(frozen=True, slots=True)
class ChunkScheduled(Event):
    """This step computes tokens [start, start + num_tokens) of a sequence."""

    seq_id: str
    start: int
    num_tokens: int
    is_prefill: bool                  # False: a single decode token


@dataclass(frozen=True, slots=True)
class BlocksAllocated(Event):
    """Blocks taken from the free queue and appended to a sequence's block table."""

    seq_id: str
    block_ids: tuple[int, ...]
    group: int = 0                    # KV cache group (kv_groups.py): 0 unless the model has several


@dataclass(frozen=True, slots=True)
class BlocksFreed(Event):
    """A sequence dropped its blocks; `released` went back to the free queue, in that order."""

    seq_id: str
    block_ids: tuple[int, ...]
    released: tuple[int, ...]
    group: int = 0                    # KV cache group (kv_groups.py)


@dataclass(frozen=True, slots=True)
class Preempted(Event):
    """A running sequence was evicted to make room; it recomputes its KV later, or swaps it back in."""

    seq_id: str
    mode: str                         # "recompute" (KV dropped) or "swap" (KV moved to the CPU pool)
    num_tokens_lost: int              # tokens whose KV must be computed again (0 for a swap)


@dataclass(frozen=True, slots=True)
class TokenSampled(Event):
    """A sequence got a new token; `text` is what it added to the visible output."""

    seq_id: str
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenConstrained(Event):
    """Structured output: the grammar's mask at the position of the token just sampled (TokenSampled follows)."""

    seq_id: str
    token_id: int
    num_allowed: int                  # tokens of the vocabulary the mask allowed
    vocab_size: int
    top_masked: bool                  # the model's own most likely token was forbidden
    forced: bool                      # exactly one token was allowed: the grammar chose it, not the model


@dataclass(frozen=True, slots=True)
class SequenceFinished(Event):
    """A sequence ended: "stop", "length" or "abort" (with `error` when the engine gave up on it).
    Its request ends with its last sequence."""

    seq_id: str
    finish_reason: str
    num_output_tokens: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class SequenceAborted(Event):
    """A user called abort_request on a sequence (or on its request) that had not finished."""

    seq_id: str


@dataclass(frozen=True, slots=True)
class StepFinished(Event):
    """A step ended: what the forward pass computed and what is left in the pool."""

    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_free_blocks: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class DraftProposed(Event):
    """Speculative decoding: a proposer guessed these next tokens for a sequence."""

    seq_id: str
    method: str                       # "ngram" or "draft"
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DraftVerified(Event):
    """The target checked a sequence's draft: how many it accepted and what it emitted after them."""

    seq_id: str
    num_drafted: int
    num_accepted: int
    first_rejected: int               # index of the first rejected draft token, -1 if all were accepted
    token_id: int                     # the corrected token (after a rejection) or the bonus token
    is_bonus: bool                    # True: every draft was accepted and token_id is the extra one


@dataclass(frozen=True, slots=True)
class KVTrimmed(Event):
    """KV written for rejected draft positions is dropped: the sequence keeps num_computed_tokens."""

    seq_id: str
    num_computed_tokens: int
    num_tokens_dropped: int
    block_ids: tuple[int, ...]        # trailing blocks given back (also in a BlocksFreed event)


# -- memory mechanisms: radix prefix cache, copy-on-write fork, swap ----------------------

@dataclass(frozen=True, slots=True)
class PrefixMatched(Event):
    """A sequence looked its tokens up in the radix cache; the hit blocks join its table (0 tokens: a miss)."""

    seq_id: str
    num_tokens: int                   # tokens looked up (the prompt, or prompt + output after preemption)
    num_hit_tokens: int               # tokens whose KV is reused: their prefill is skipped
    block_ids: tuple[int, ...]        # the cached blocks now at the start of the sequence's table
    group_block_ids: tuple[tuple[int, ...], ...] = ()   # groups 1..: the cached blocks each now holds


@dataclass(frozen=True, slots=True)
class RadixInserted(Event):
    """A new tree node: a sequence's freshly filled blocks, under `parent_id` (0 is the root)."""

    seq_id: str
    node_id: int
    parent_id: int
    text: str                         # the span's tokens as text
    num_tokens: int
    block_ids: tuple[int, ...]        # the tree takes one reference on each


@dataclass(frozen=True, slots=True)
class RadixSplit(Event):
    """A node was cut at a block boundary: its first `num_blocks` blocks move to a new parent node."""

    node_id: int                      # keeps the tail of the span, and its children
    new_node_id: int                  # the head: parent of node_id, child of node_id's old parent
    num_blocks: int
    head_text: str
    tail_text: str


@dataclass(frozen=True, slots=True)
class RadixLocked(Event):
    """The deepest tree node a sequence holds moved (0: it holds none). A node's lock count is
    the number of sequences holding it or a node below it."""

    seq_id: str
    node_id: int


@dataclass(frozen=True, slots=True)
class RadixEvicted(Event):
    """An unlocked leaf was evicted (least recently used first); its blocks went back to the free queue."""

    node_id: int
    block_ids: tuple[int, ...]        # appended to the free queue in this order
    last_access: int                  # the step it was last matched or extended


@dataclass(frozen=True, slots=True)
class BlockDeduplicated(Event):
    """A sequence's full block turned out to be in the cache already: it now uses the cached block."""

    seq_id: str
    index: int                        # position in the sequence's block table
    dropped: int                      # its own copy (freed, back to the free queue if nobody else holds it)
    kept: int                         # the cached block with the same tokens
    released: bool                    # True when `dropped` reached the free queue
    group: int = 0                    # KV cache group (kv_groups.py)


@dataclass(frozen=True, slots=True)
class Forked(Event):
    """A new sequence shares all of its parent's blocks (n > 1, beam search or engine.fork)."""

    parent_id: str
    seq_id: str                       # the new sequence
    block_ids: tuple[int, ...]        # the shared table: every ref count went up by one
    seed: int = -1                    # the seed of the new sequence's RNG (-1: not recorded)


@dataclass(frozen=True, slots=True)
class CowCopied(Event):
    """Copy-on-write: a sequence about to write into a shared block got its own copy of it."""

    seq_id: str
    index: int                        # position in the sequence's block table
    src: int                          # the shared block (one holder fewer)
    dst: int                          # a fresh block from the free queue, holding a copy of src's KV
    group: int = 0                    # KV cache group (kv_groups.py)


@dataclass(frozen=True, slots=True)
class BeamPruned(Event):
    """Beam search dropped a beam that none of the best candidates continued; its blocks are freed."""

    seq_id: str


@dataclass(frozen=True, slots=True)
class SwappedOut(Event):
    """Swap preemption: a sequence's KV blocks were copied to the CPU pool and freed on the device."""

    seq_id: str
    block_ids: tuple[int, ...]        # device blocks, in table order (one holder fewer each)
    released: tuple[int, ...]         # the device blocks that went back to the free queue, in that order
    cpu_block_ids: tuple[int, ...]    # where each one's KV now lives
    group: int = 0                    # KV cache group (kv_groups.py): one event per group


@dataclass(frozen=True, slots=True)
class SwappedIn(Event):
    """A swapped sequence came back: its KV was copied from the CPU pool into fresh device blocks."""

    seq_id: str
    cpu_block_ids: tuple[int, ...]    # freed in the CPU pool
    block_ids: tuple[int, ...]        # fresh device blocks, in table order
    group: int = 0                    # KV cache group (kv_groups.py): one event per group


# -- across processes: tensor parallelism, prefill/decode disaggregation (nanoserve/distributed/) --------

@dataclass(frozen=True, slots=True)
class CollectiveOps(Event):
    """Tensor parallelism: what the driver sent or summed with the other ranks this step, of one kind."""

    kind: str                         # "broadcast" (the step's batch), "all_reduce" (row-parallel layers and
                                      # the embedding), "gather" (logits), "gather_object" (rank reports)
    count: int                        # calls this step
    num_bytes: int                    # payload rank 0 put in (an all-reduce of [T, hidden] fp32: T * hidden * 4)
    duration_s: float                 # rank 0's time inside them, waiting for the slowest rank included


@dataclass(frozen=True, slots=True)
class RankPoolState(Event):
    """Tensor parallelism: one rank's KV pool after a step, as that rank reports it (same block
    tables on every rank; each pool holds only its own KV heads)."""

    rank: int
    kv_heads: tuple[int, ...]         # the model's KV heads whose K/V this rank's pool holds
    bytes_per_block: int              # this rank's share of one block (all layers, K and V)
    num_blocks_written: int           # blocks the forward wrote K/V into this step
    num_blocks_copied: int            # copy-on-write copies it made
    num_blocks_swapped: int           # blocks it swapped out or in
    digest: str                       # hash of which token each slot holds: equal on every rank


@dataclass(frozen=True, slots=True)
class KVTransferred(Event):
    """Disaggregation: a request's KV arrived from another engine's pool and now fills these blocks."""

    request_id: str
    src: str                          # "prefill": the engine that computed it
    dst: str                          # "decode": this engine
    src_block_ids: tuple[int, ...]    # the blocks it came from, in the sender's pool
    block_ids: tuple[int, ...]        # where it landed in this pool, in table order (the block mapping)
    num_tokens: int                   # tokens whose KV came (the last prompt token is computed here)
    num_bytes: int
    duration_s: float                 # from the sender's request to the KV in this pool

    @property
    def seq_id(self) -> str:
        """The id of the request's first sequence: the request's own."""
        return self.request_id


@dataclass(frozen=True, slots=True)
class GroupsCached(Event):
    """The prefix cache took group 0's new blocks (RadixInserted): it holds these, at the same positions in
    KV cache groups 1.., with them (one reference each), and frees them when it evicts those."""

    seq_id: str
    block_ids: tuple[int, ...]                    # group 0's newly cached blocks
    group_block_ids: tuple[tuple[int, ...], ...]  # per block: its companions in groups 1..


@dataclass(frozen=True, slots=True)
class GroupsForked(Event):
    """After Forked: the new sequence shares its parent's tables in KV cache groups 1.. too (kv_groups.py)."""

    parent_id: str
    seq_id: str
    group_block_ids: tuple[tuple[int, ...], ...]   # per group 1..: the shared table (-1: left the window)


@dataclass(frozen=True, slots=True)
class CompanionEvicted(Event):
    """The prefix cache let go of a cached block's companion in one KV cache group (group_cache.py)."""

    block_id: int                     # the cached group-0 block it went with
    group: int
    companion: int                    # the block it held in that group (one holder fewer)
    released: bool                    # True when it reached the free queue


@dataclass(frozen=True, slots=True)
class BlocksLeftWindow(Event):
    """A windowed KV group's blocks fell out of its sliding window: the sequence lets them go (kv_groups.py)."""

    seq_id: str
    group: int                        # the windowed group (1..; group 0 holds every token)
    window: int                       # its layers' sliding window, in tokens
    num_computed_tokens: int          # the next query's position: keys <= this - window are never read again
    indices: tuple[int, ...]          # positions in the group's table, now empty
    block_ids: tuple[int, ...]        # the blocks they held (one holder fewer each)
    released: tuple[int, ...]         # those that went back to the free queue (the rest stay cached)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        EngineSynced, StepStarted, RequestAdded, SequenceAdmitted, ChunkScheduled, BlocksAllocated,
        BlocksFreed, Preempted, TokenConstrained, TokenSampled, SequenceFinished, SequenceAborted, StepFinished,
        DraftProposed, DraftVerified, KVTrimmed, PrefixMatched, RadixInserted, RadixSplit, RadixLocked,
        RadixEvicted, BlockDeduplicated, Forked, CowCopied, BeamPruned, SwappedOut, SwappedIn,
        CollectiveOps, RankPoolState, KVTransferred, BlocksLeftWindow, GroupsCached,
        CompanionEvicted, GroupsForked,
    )
}
