"""Sequence: one stream of tokens of a request, with its KV bookkeeping and lifecycle.

A sequence is the unit the scheduler moves around. It knows its tokens
(prompt + generated), how many of them already have KV in the cache
(`num_computed_tokens`), which physical blocks hold that KV (`block_table`),
and where it is in its life:

    WAITING ──admit──▶ RUNNING ──finish──▶ FINISHED_STOPPED / FINISHED_LENGTH
       ▲                  │
       └───preempt────────┘            (any unfinished state) ──abort──▶ FINISHED_ABORTED
    RUNNING ──swap out──▶ SWAPPED ──swap in──▶ RUNNING
                          SWAPPED ──(a failed step never ran the copy)──▶ WAITING

Preemption by recompute sends a RUNNING sequence back to WAITING with its
blocks freed and `num_computed_tokens = 0`; its generated tokens are kept and
recomputed as if they were prompt. Preemption by swap copies its KV to the
CPU block pool (`cpu_block_table`) and parks it as SWAPPED until there is
room to copy it back.

The words, used the same way in code, events, snapshots and docs:

* a *request* is what a user adds (`add_request`): a prompt and its sampling
  parameters; `Request` in `request.py`, `engine.requests` by request id;
* a *sequence* is one stream of tokens of a request, the unit the scheduler
  moves and the block tables belong to: this class, `engine.sequences` by
  `seq_id`. A request starts with one, whose `seq_id` is the request's id;
  `n > 1` and beam search fork it ("r1.1", "r1.2", ...; they share its blocks),
  and `request_id` names the request a sequence belongs to;
* a *completion* is what the user gets back for one sequence
  (`CompletionOutput` in `outputs.py`): n of them per request, or the best
  beams (a pruned beam is a sequence that never becomes a completion).

The scheduler owns the transitions; the engine owns text and stop checks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from nanoserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM name of a finished state: "stop", "length" or "abort"."""
        return _FINISH_REASON.get(self)


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}
# Allowed moves of the state machine above; anything else is a bug.
_TRANSITIONS = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING, SequenceStatus.SWAPPED, *_FINISHED},
    SequenceStatus.SWAPPED: {SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED_ABORTED},
}


@dataclass(slots=True, eq=False)   # an entity: two sequences are equal only if they are the same one
class Sequence:
    seq_id: str                          # this sequence's id: the request's, or "<request>.<index>" for forks
    prompt: str | None                   # the text, when the request came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None  # this sequence's RNG (a fork gets its own; seeded runs repeat)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # physical block id per block of context
    num_computed_tokens: int = 0         # tokens whose K/V are written in the cache
    output_text: str = ""                # detokenized output, stop string excluded
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token so far, when
                                         # params.prompt_logprobs is set ([None] at first: token 0 has no context)
    error: str | None = None             # why the engine gave up on this sequence, if it did
    num_sampling_steps: int = 0          # target forwards that produced tokens for this sequence
    num_drafted: int = 0                 # speculative decoding: draft tokens proposed and checked
    num_accepted: int = 0                # ... and how many of them the target accepted
    first_token_time: float | None = None
    finish_time: float | None = None
    request_id: str = ""                 # the request this sequence belongs to ("" means seq_id: the first one)
    index: int = 0                       # which of the request's completions (forks count up)
    seats: int = 1                       # places in the running batch it takes: n until a request forks
    priority: int = 0                    # preemption_policy="priority": the lowest is preempted first
    cache_node: object | None = None     # radix_cache.RadixNode: the deepest cached node it holds locked
    cpu_block_table: list[int] = field(default_factory=list)   # swap: where its KV waits in the CPU pool
    # KV cache groups 1.. (kv_groups.py; empty for a model with one group): one table per group, indexed
    # as block_table, a windowed group's entries for blocks that left its window FREED (-1); and swapped out
    group_tables: list[list[int]] = field(default_factory=list)
    cpu_group_tables: list[list[int]] = field(default_factory=list)
    beam_logprobs: torch.Tensor | None = None   # beam search: next-token log-probs waiting for the other beams
    beam_mask: object | None = None      # ... and what the grammar's mask did to them (structured_output.MaskInfo)
    pruned: bool = False                 # beam search dropped this beam
    grammar: object | None = None        # structured output: structured_output.SequenceGrammar (its matcher)

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = self.seq_id

    # -- token counts -------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still without KV: the whole prompt at first, 1 when decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities were asked for and some are still missing (prompt_logprobs.py)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token still lacks KV (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    # -- lifecycle -----------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def set_status(self, new: SequenceStatus) -> None:
        """Move along the state machine; raise on a move it does not have."""
        if new not in _TRANSITIONS.get(self.status, ()):
            raise RuntimeError(f"{self.seq_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new
        if new.is_finished:
            self.finish_time = time.monotonic()

    def fork(self, child_id: str, generator: torch.Generator) -> Sequence:
        """A running copy at the same position: same tokens, text and log-probs, its own id and RNG,
        and its own copy of the grammar's matcher. (Blocks are shared by the KV manager; the copy
        starts with none.)"""
        return Sequence(
            child_id, self.prompt, self.prompt_token_ids, self.params, arrival_time=self.arrival_time,
            generator=generator, status=SequenceStatus.RUNNING, output_token_ids=list(self.output_token_ids),
            output_text=self.output_text, cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,   # complete by now, never changed again: shared
            first_token_time=self.first_token_time, request_id=self.request_id,
            index=int(child_id.rsplit(".", 1)[1]), priority=self.priority,
            grammar=self.grammar.fork() if self.grammar is not None else None,
        )
