"""Commit: the last phase of a step, where what the compute phase chose is applied to the request table.

The compute phase (`token_choice.py`) decided a `Choice` per chunk without touching
any bookkeeping; here each is applied through the `RequestTable`'s verbs
(`request_table.py`), choice by choice (one per sequence that sampled), then
each beam search whose beams are all scored:

* speculative decoding: the `Verdict`'s accepted drafts keep their KV, the
  rejected positions are trimmed (`table.accept_drafts`); drafts that were
  proposed but never ran (no budget left) are rolled back in the proposer;
* a request with n > 1 whose prompt is done forks its n - 1 other completions
  (they share the prompt's blocks) and each appends its first token;
* every sequence appends its tokens (text, stop conditions, finishing:
  `table.append`);
* a beam search whose live beams all have their next-token scores gets a
  `BeamStep` from `beam_search.decide`, whichever step brought the last beam
  back, and the table forks, prunes and appends what it says (`apply_beam_step`).

Beam search and speculative decoding only decide; forking, appending,
trimming and pruning happen here, through the table's verbs. Nothing here
calls the engine: commit flows one way, engine -> commit -> table ->
scheduler / KV manager / detokenizer.

A failure is contained to its request: unusable logits (the Choice's
`error`) or an exception while applying one request's tokens finish that
request with finish_reason "abort" and an `error` saying why, its blocks
released, and the step goes on for the others.
"""

from __future__ import annotations

import torch

from nanoserve import beam_search
from nanoserve.outputs import RequestOutput
from nanoserve.request_table import RequestTable
from nanoserve.spec_decode import Drafts
from nanoserve.token_choice import Choice


def commit(table: RequestTable, chosen: list[Choice], drafts: Drafts,
           outputs: dict[str, RequestOutput]) -> tuple[int, int]:
    """Apply the step's choices; returns (draft tokens verified, accepted)."""
    drafted = accepted = 0
    for choice in chosen:
        seq = choice.chunk.seq
        if seq.is_finished:        # (its request failed with an earlier choice of this step)
            continue
        try:
            if choice.error is not None:
                fail_request(table, seq.request_id, choice.error, outputs)
            elif choice.beam_logprobs is not None:
                seq.beam_logprobs, seq.beam_mask = choice.beam_logprobs, choice.beam_mask
            else:
                if choice.verdict is not None:
                    table.accept_drafts(seq, len(choice.chunk.draft_token_ids), choice.verdict)
                    drafted += len(choice.chunk.draft_token_ids)
                    accepted += choice.verdict.num_accepted
                forks = []
                if choice.forks:   # n > 1: the prompt is done; the n sequences share its blocks
                    table.requests[seq.request_id].forked, seq.seats = True, 1
                    forks = [(table.fork(seq, g), token) for g, token in choice.forks]
                outputs[seq.request_id] = table.append(seq, choice.tokens)
                for fork, token in forks:
                    outputs[seq.request_id] = table.append(fork, [token])
        except Exception as exc:   # noqa: BLE001 -- one request's failure must not stop the others
            fail_request(table, seq.request_id, f"{type(exc).__name__}: {exc}", outputs)
    ran = {c.chunk.seq.seq_id for c in chosen if c.chunk.draft_token_ids}
    for rid in drafts.tokens.keys() - ran:   # drafts that were proposed but not run (no budget left) roll back
        table.drop_drafts(rid, drafts.num_tokens[rid])
    for request in [r for r in table.requests.values() if r.is_beam_search and beam_search.ready(r)]:
        try:
            decided = beam_search.decide(request, table.free_seats(), table.eos_token_id)
            apply_beam_step(table, request, decided, outputs)
        except Exception as exc:   # noqa: BLE001
            fail_request(table, request.request_id, f"{type(exc).__name__}: {exc}", outputs)
    return drafted, accepted


def apply_beam_step(table: RequestTable, request, decided: beam_search.BeamStep,
                    outputs: dict[str, RequestOutput]) -> None:
    """Beam search: fork, prune and append what `beam_search.decide` chose; then drop the live beams
    that can no longer beat the finished ones."""
    request.forked = True
    for s in request.live:
        s.seats = 1
    # Forks first, while every parent still has the state the candidates extend.
    continuing = [(table.fork(beam, torch.Generator().manual_seed(request.seed)) if fork else beam, token)
                  for beam, token, fork in decided.continuations]
    for s in decided.pruned:
        outputs[request.request_id] = table.prune(s)
    for seq, _ in continuing:
        seq.beam_logprobs = seq.beam_mask = None
    for seq, token in continuing:
        outputs[request.request_id] = table.append(seq, [token])
    for s in beam_search.finished_early(request):
        outputs[request.request_id] = table.prune(s)


def fail_request(table: RequestTable, request_id: str, error: str, outputs: dict[str, RequestOutput]) -> None:
    """Finish every live sequence of a request with an error (finish_reason "abort", blocks released)."""
    out = table.fail(request_id, error)
    if out is not None:
        outputs[request_id] = out
