"""Events: what the engine decided, as small frozen plain-data records.

Every decision the engine makes (admit a request, schedule a chunk, allocate
or free blocks, preempt, sample a token, finish) is published as one of these.
They hold only ints, floats, strings, bools and tuples, never tensors or live
objects, so a trace can be written to JSONL and replayed without a model.
Each carries `step`: the step it happened in (events between steps, like
`add_request`, carry the number of the last finished step, 0 at the start).

Viewers (TUI, Graphviz, REPL, lessons) are built on these and on `fold()` in
`trace.py`, never on engine internals.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # (request_id, status, prompt, num_prompt_tokens, output_text, num_output_tokens,
    #  num_computed_tokens, block_table, max_tokens) per live request, waiting ones included
    requests: tuple[tuple, ...]


@dataclass(frozen=True, slots=True)
class StepStarted(Event):
    """A step begins: how many requests wait and run before scheduling."""

    num_waiting: int
    num_running: int


@dataclass(frozen=True, slots=True)
class RequestAdded(Event):
    """A request entered the waiting queue."""

    request_id: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class RequestAdmitted(Event):
    """A waiting request got its first blocks and joined the running batch."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ChunkScheduled(Event):
    """This step computes tokens [start, start + num_tokens) of a request."""

    request_id: str
    start: int
    num_tokens: int
    is_prefill: bool                  # False: a single decode token


@dataclass(frozen=True, slots=True)
class BlocksAllocated(Event):
    """Blocks taken from the free queue and appended to a request's block table."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksFreed(Event):
    """A request dropped its blocks; `released` went back to the free queue, in that order."""

    request_id: str
    block_ids: tuple[int, ...]
    released: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Preempted(Event):
    """A running request was evicted to make room; it will recompute its KV later."""

    request_id: str
    mode: str                         # "recompute"
    num_tokens_lost: int              # tokens whose KV must be computed again


@dataclass(frozen=True, slots=True)
class TokenSampled(Event):
    """A request got a new token; `text` is what it added to the visible output."""

    request_id: str
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    """A request ended: "stop", "length" or "abort" (with `error` when the engine gave up on it)."""

    request_id: str
    finish_reason: str
    num_output_tokens: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class RequestAborted(Event):
    """A user called abort_request on a request that had not finished."""

    request_id: str


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
    """Speculative decoding: a proposer guessed these next tokens for a request."""

    request_id: str
    method: str                       # "ngram" or "draft"
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DraftVerified(Event):
    """The target checked a request's draft: how many it accepted and what it emitted after them."""

    request_id: str
    num_drafted: int
    num_accepted: int
    first_rejected: int               # index of the first rejected draft token, -1 if all were accepted
    token_id: int                     # the corrected token (after a rejection) or the bonus token
    is_bonus: bool                    # True: every draft was accepted and token_id is the extra one


@dataclass(frozen=True, slots=True)
class KVTrimmed(Event):
    """KV written for rejected draft positions is dropped: the request keeps num_computed_tokens."""

    request_id: str
    num_computed_tokens: int
    num_tokens_dropped: int
    block_ids: tuple[int, ...]        # trailing blocks given back (also in a BlocksFreed event)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        EngineSynced, StepStarted, RequestAdded, RequestAdmitted, ChunkScheduled, BlocksAllocated,
        BlocksFreed, Preempted, TokenSampled, RequestFinished, RequestAborted, StepFinished,
        DraftProposed, DraftVerified, KVTrimmed,
    )
}
