"""Commit: the last phase of a step, where the engine applies what the compute phase chose.

The compute phase (`token_choice.py`) decided a `Choice` per chunk without touching
any bookkeeping; here the engine applies them, choice by choice (one per
sequence that sampled), then each beam search whose beams are all scored:

* speculative decoding: the `Verdict`'s accepted drafts keep their KV, the
  rejected positions are trimmed (`accept_drafts`); drafts that were
  proposed but never ran (no budget left) are rolled back in the proposer;
* a request with n > 1 whose prompt is done forks its n - 1 other completions
  (they share the prompt's blocks) and each appends its first token;
* every sequence appends its tokens (text, stop conditions, finishing:
  `engine.append_tokens`);
* a beam search whose live beams all have their next-token scores gets a
  `BeamStep` from `beam_search.decide`, whichever step brought the last beam
  back, and the engine forks, prunes and appends what it says (`apply_beam_step`).

Beam search and speculative decoding only decide; forking, appending,
trimming and pruning happen here, through the engine's own methods.

A failure is contained to its request: unusable logits (the Choice's
`error`) or an exception while applying one request's tokens finish that
request with finish_reason "abort" and an `error` saying why, its blocks
released, and the step goes on for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve import beam_search
from nanoserve import events as ev
from nanoserve.outputs import RequestOutput
from nanoserve.sequence import SequenceStatus
from nanoserve.spec_decode import Drafts, Verdict
from nanoserve.token_choice import Choice

if TYPE_CHECKING:                      # (a type only: engine.py imports this module)
    from nanoserve.engine import LLMEngine


def commit(engine: LLMEngine, chosen: list[Choice], drafts: Drafts, outputs: dict[str, RequestOutput]) -> tuple[int, int]:
    """Apply the step's choices; returns (draft tokens verified, accepted)."""
    drafted = accepted = 0
    for choice in chosen:
        seq = choice.chunk.seq
        if seq.is_finished:        # (its request failed with an earlier choice of this step)
            continue
        try:
            if choice.error is not None:
                fail_request(engine, seq.request_id, choice.error, outputs)
            elif choice.beam_logprobs is not None:
                seq.beam_logprobs, seq.beam_mask = choice.beam_logprobs, choice.beam_mask
            else:
                if choice.verdict is not None:
                    accept_drafts(engine, seq, len(choice.chunk.draft_token_ids), choice.verdict)
                    drafted += len(choice.chunk.draft_token_ids)
                    accepted += choice.verdict.num_accepted
                forks = []
                if choice.forks:   # n > 1: the prompt is done; the n sequences share its blocks
                    engine.requests[seq.request_id].forked, seq.seats = True, 1
                    forks = [(engine.fork_sequence(seq, g), token) for g, token in choice.forks]
                outputs[seq.request_id] = engine.append_tokens(seq, choice.tokens)
                for fork, token in forks:
                    outputs[seq.request_id] = engine.append_tokens(fork, [token])
        except Exception as exc:   # noqa: BLE001 -- one request's failure must not stop the others
            fail_request(engine, seq.request_id, f"{type(exc).__name__}: {exc}", outputs)
    if engine.proposer:            # drafts that were proposed but not run (no budget left) roll back too
        ran = {c.chunk.seq.seq_id for c in chosen if c.chunk.draft_token_ids}
        for rid in drafts.tokens.keys() - ran:
            if rid in engine.sequences:
                engine.proposer.accepted(engine.sequences[rid], drafts.num_tokens[rid], 0)
    for request in [r for r in engine.requests.values() if r.is_beam_search and beam_search.ready(r)]:
        try:
            free_seats = engine.config.max_num_seqs - engine.scheduler.seats_used
            apply_beam_step(engine, request, beam_search.decide(request, free_seats, engine.eos_token_id), outputs)
        except Exception as exc:   # noqa: BLE001
            fail_request(engine, request.request_id, f"{type(exc).__name__}: {exc}", outputs)
    engine.count_verified(drafted, accepted)
    return drafted, accepted


def accept_drafts(engine: LLMEngine, seq, n: int, verdict: Verdict) -> None:
    """Speculative decoding, `n` drafts checked: the last real token and the accepted drafts have valid KV,
    the rejected positions do not: roll those back (target and draft caches) and say so. The Verdict's
    tokens are appended next."""
    accepted = verdict.num_accepted
    num_tokens_before = seq.num_tokens
    seq.num_drafted += n
    seq.num_accepted += accepted
    seq.num_computed_tokens += accepted
    freed = engine.kv.trim(seq)
    engine.proposer.accepted(seq, num_tokens_before, accepted)
    step = engine.step_count
    engine.emit(ev.DraftVerified(step, seq.seq_id, n, accepted, accepted if accepted < n else -1,
                                  verdict.tokens[-1].token_id, accepted == n))
    engine.emit(ev.KVTrimmed(step, seq.seq_id, seq.num_computed_tokens, n - accepted, freed))


def apply_beam_step(engine: LLMEngine, request, decided: beam_search.BeamStep, outputs: dict[str, RequestOutput]) -> None:
    """Beam search: fork, prune and append what `beam_search.decide` chose; then drop the live beams
    that can no longer beat the finished ones."""
    request.forked = True
    for s in request.live:
        s.seats = 1
    # Forks first, while every parent still has the state the candidates extend.
    continuing = [(engine.fork_sequence(beam, torch.Generator().manual_seed(request.seed)) if fork else beam, token)
                  for beam, token, fork in decided.continuations]
    for s in decided.pruned:
        outputs[request.request_id] = engine.prune_beam(s)
    for seq, _ in continuing:
        seq.beam_logprobs = seq.beam_mask = None
    for seq, token in continuing:
        outputs[request.request_id] = engine.append_tokens(seq, [token])
    for s in beam_search.finished_early(request):
        outputs[request.request_id] = engine.prune_beam(s)


def fail_request(engine: LLMEngine, request_id: str, error: str, outputs: dict[str, RequestOutput]) -> None:
    """Finish every live sequence of a request with an error (finish_reason "abort", blocks released)."""
    request = engine.requests.get(request_id)
    for seq in request.live if request is not None else []:
        seq.error = f"step {engine.step_count}: {error}"
        outputs[request_id] = engine.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED, delta="")
