"""RequestTable: the live requests and their sequences, and the verbs that apply a step's tokens to them.

The engine conducts a step (plan -> compute -> commit); this table is what
the commit phase changes. It owns

* the unfinished requests and sequences by id, each sequence's detokenizer,
  the text each sequence added in the current step (`deltas`), the ids of the
  requests that are over (for clear errors), and speculative decoding's totals;
* the verbs that change them: `add` a prepared request, `append` a step's
  tokens (text, log-probs, stop conditions), `fork` a sequence, `prune` a
  beam, `accept_drafts` (trim the rejected positions), `finish`, `fail`, `abort`.

It is built with the parts it needs, as the scheduler is: the scheduler (it
queues a new sequence, closes a finished one), the KV manager (a fork shares
blocks, a verdict trims them), the proposer (draft state per sequence), the
tokenizer and EOS id, the config's limits, `emit` and the step clock. It never
calls the engine: commit flows one way, engine -> commit -> table ->
scheduler / KV manager / detokenizer (nano-vllm's `Scheduler.postprocess`,
vLLM's `update_from_output` play the same part).

Left to others: checking a new request (`intake.py`), deciding tokens
(`token_choice.py`, `beam_search.decide`, `spec_decode.decide`), what to do
with each choice (`commit.py`), blocks and queues (`kv_manager.py`, `scheduler.py`).

The stop conditions `append_token` checks, in their order:

1. nothing stops a sequence before `min_tokens` (EOS and stop strings included);
2. EOS (unless `ignore_eos`), a stop token id, a completed stop string, or a
   structured output's grammar that can only end here: "stop";
3. `max_tokens` output tokens, or `max_model_len` tokens in all: "length".

With structured output the token also advances the sequence's grammar matcher
(the only place it advances) and gets a TokenConstrained event.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from nanoserve import events as ev
from nanoserve.config import EngineConfig
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.intake import PreparedRequest
from nanoserve.kv_manager import KVManager
from nanoserve.outputs import RequestOutput
from nanoserve.request import Request
from nanoserve.sampler import SampledToken
from nanoserve.sampling_params import to_pairs
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence, SequenceStatus
from nanoserve.spec_decode import Verdict


def prompt_text(text: str | None, token_ids: list[int], tokenizer) -> str:
    """The prompt as viewers show it: its text; for a token-id prompt, the text those ids decode to
    (special tokens included), or the ids themselves when the model has no tokenizer."""
    if text is not None:
        return text
    if tokenizer is not None:
        return tokenizer.decode(token_ids)
    return str(list(token_ids))


class RequestTable:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, kv: KVManager, proposer, tokenizer,
                 eos_token_id: int | None, emit: Callable[[ev.Event], None], clock: ev.StepClock) -> None:
        self.config = config                  # max_model_len (a stop condition), max_num_seqs (free seats)
        self.scheduler = scheduler
        self.kv = kv
        self.proposer = proposer              # speculative decoding's proposer; None when it is off
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.emit = emit
        self.clock = clock
        self.requests: dict[str, Request] = {}         # unfinished requests by id, with all their sequences
        self.sequences: dict[str, Sequence] = {}       # unfinished sequences by id (a request's first has its id)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}   # by sequence id
        self.deltas: dict[str, str] = {}               # text each sequence added in the current step
        self.finished_ids: set[str] = set()            # requests that are over, for clear errors
        # Speculative decoding over the engine's life: drafted, accepted, tokens, sampling forwards.
        self.spec_totals = {"drafted": 0, "accepted": 0, "tokens": 0, "forwards": 0}

    # -- in and out ----------------------------------------------------------------------

    def add(self, prepared: PreparedRequest) -> None:
        """Register a request `intake.prepare` built and checked, queue its sequence, say so (cannot fail)."""
        seq, request = prepared.seq, prepared.request
        rid = request.request_id
        self.requests[rid] = request
        self.finished_ids.discard(rid)
        self.sequences[rid] = seq
        self.detokenizers[rid] = prepared.detokenizer
        self.scheduler.add(seq)
        shown = prompt_text(seq.prompt, seq.prompt_token_ids, self.tokenizer)   # token ids: their text
        given_ids = tuple(seq.prompt_token_ids) if seq.prompt is None else ()   # what a replay adds again
        self.emit(ev.RequestAdded(self.clock.step, rid, shown, seq.num_prompt_tokens, request.params.max_tokens,
                                  given_ids, to_pairs(request.params, request.seed), seq.priority))

    def unknown(self, request_id: str) -> str:
        """The KeyError's text for an id that names no unfinished request or sequence."""
        if request_id in self.finished_ids:
            return f"request {request_id!r} has already finished"
        return f"no unfinished request {request_id!r}"

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its sequences), or one sequence ("r1.2"), now. KeyError for an unknown id."""
        if request_id in self.requests:
            seqs = self.requests[request_id].live
        elif request_id in self.sequences:
            seqs = [self.sequences[request_id]]
        else:
            raise KeyError(self.unknown(request_id))
        out = None
        for seq in seqs:
            self.emit(ev.SequenceAborted(self.clock.step, seq.seq_id))
            out = self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return out

    def begin_step(self) -> None:
        """A new step: no sequence has added text in it yet."""
        self.deltas = {}

    def free_seats(self) -> int:
        """How many more sequences may run now (a fork or a beam takes one)."""
        return self.config.max_num_seqs - self.scheduler.seats_used

    # -- the commit phase's verbs (commit.py calls them) --------------------------------------

    def fork(self, parent: Sequence, generator: torch.Generator, seed: int = -1) -> Sequence:
        """A new running sequence of the same request, sharing `parent`'s tokens, text and blocks.
        (`seed`, the seed of `generator` when the caller knows it, goes into the Forked event.)"""
        request = self.requests[parent.request_id]
        child_id = request.fork_id()
        while child_id in self.sequences or child_id in self.requests:   # a user's request may have this id
            child_id = request.fork_id()
        child = parent.fork(child_id, generator)
        self.kv.fork(parent, child, seed)
        if parent.group_tables:        # KV cache groups 1.. (kv_groups.py): their tables are shared too
            self.kv.fork_groups(parent, child)
        self.scheduler.running.append(child)
        request.seqs.append(child)
        self.sequences[child_id] = child
        self.detokenizers[child_id] = self.detokenizers[parent.seq_id].fork()
        return child

    def prune(self, seq: Sequence) -> RequestOutput:
        """Drop a beam: free its blocks, forget it (it is no completion of the request)."""
        self.emit(ev.BeamPruned(self.clock.step, seq.seq_id))
        seq.pruned = True
        self.requests[seq.request_id].seqs.remove(seq)
        return self.finish(seq, SequenceStatus.FINISHED_ABORTED, quiet=True)

    def accept_drafts(self, seq: Sequence, n: int, verdict: Verdict) -> None:
        """Speculative decoding, `n` drafts checked: the last real token and the accepted drafts have valid KV,
        the rejected positions do not: roll those back (target and draft caches) and say so. The Verdict's
        tokens are appended next."""
        accepted = verdict.num_accepted
        num_tokens_before = seq.num_tokens
        seq.num_drafted += n
        seq.num_accepted += accepted
        seq.num_computed_tokens += accepted
        freed = self.kv.trim(seq)
        self.proposer.accepted(seq, num_tokens_before, accepted)
        step = self.clock.step
        self.emit(ev.DraftVerified(step, seq.seq_id, n, accepted, accepted if accepted < n else -1,
                                   verdict.tokens[-1].token_id, accepted == n))
        self.emit(ev.KVTrimmed(step, seq.seq_id, seq.num_computed_tokens, n - accepted, freed))
        self.spec_totals["drafted"] += n
        self.spec_totals["accepted"] += accepted

    def drop_drafts(self, seq_id: str, num_tokens: int) -> None:
        """Drafts were proposed for `seq_id` (then `num_tokens` long) but not run: the proposer forgets them."""
        if seq_id in self.sequences:
            self.proposer.accepted(self.sequences[seq_id], num_tokens, 0)

    def append(self, seq: Sequence, tokens: list[SampledToken]) -> RequestOutput:
        """This step's tokens for `seq` (one, or several with speculation), until one finishes the sequence."""
        seq.num_sampling_steps += 1
        self.spec_totals["forwards"] += 1
        delta = ""
        for token in tokens:
            self.spec_totals["tokens"] += 1
            status, text = self.append_token(seq, token)
            delta += text
            if status is not None:
                return self.finish(seq, status, delta)
        self.deltas[seq.seq_id] = self.deltas.get(seq.seq_id, "") + delta
        return self.requests[seq.request_id].output(self.deltas)

    def append_token(self, seq: Sequence, token: SampledToken) -> tuple[SequenceStatus | None, str]:
        """One token: text, logprobs, stop conditions (the module docstring's order). Returns (finished
        status or None, new text); `append` finishes the sequence with that status."""
        params = seq.params
        seq.output_token_ids.append(token.token_id)
        seq.cumulative_logprob += token.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(token.top_logprobs or {token.token_id: token.logprob})
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        n = seq.num_output_tokens
        grammar_over = False
        if seq.grammar is not None:                     # raises if the grammar refuses it (the request fails)
            grammar_over = seq.grammar.accept(token.token_id)
            if token.mask is not None:
                self.emit(ev.TokenConstrained(self.clock.step, seq.seq_id, token.token_id, token.mask.num_allowed,
                                              seq.grammar.vocab_size, token.mask.top_masked, token.mask.forced))
        may_stop = n >= params.min_tokens               # nothing stops a request before min_tokens
        detokenizer = self.detokenizers[seq.seq_id]
        delta, hit_stop_string = detokenizer.update(seq.output_token_ids, may_stop)
        status = None
        is_eos = token.token_id == self.eos_token_id and not params.ignore_eos
        if may_stop and (is_eos or token.token_id in params.stop_token_ids or hit_stop_string or grammar_over):
            status = SequenceStatus.FINISHED_STOPPED
        elif n >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:   # release the text held back in case it started a stop string
            delta += detokenizer.flush()
        self.emit(ev.TokenSampled(self.clock.step, seq.seq_id, token.token_id, delta, token.logprob))
        seq.output_text += delta
        return status, delta

    def finish(self, seq: Sequence, status: SequenceStatus, delta: str = "", quiet: bool = False) -> RequestOutput:
        """Close a sequence: free its blocks, forget it, say so; the request ends with its last sequence."""
        self.deltas[seq.seq_id] = self.deltas.get(seq.seq_id, "") + delta
        self.detokenizers.pop(seq.seq_id)
        if self.proposer:
            self.proposer.release(seq.seq_id)
        if not seq.is_finished:   # (the scheduler already closed sequences it failed)
            self.scheduler.finish(seq, status)
        self.sequences.pop(seq.seq_id)
        if not quiet:             # (a pruned beam is no completion: BeamPruned said it all)
            self.emit(ev.SequenceFinished(self.clock.step, seq.seq_id, seq.status.finish_reason,
                                          seq.num_output_tokens, seq.error or ""))
        request = self.requests[seq.request_id]
        # The request ends when the table has closed its last sequence (not when the last one's
        # status says finished: the scheduler may fail two forks of a request in one step).
        if not any(s.seq_id in self.sequences for s in request.seqs):
            del self.requests[request.request_id]
            self.finished_ids.add(request.request_id)
        return request.output(self.deltas)

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """Finish every live sequence of a request with an error (finish_reason "abort", blocks released)."""
        request = self.requests.get(request_id)
        out = None
        for seq in request.live if request is not None else []:
            seq.error = f"step {self.clock.step}: {error}"
            out = self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return out
