"""Commit: the last phase of a step, where the chosen tokens become the requests' new state.

The compute phase (`choose.py`) decided a `Choice` per chunk without touching
any bookkeeping; here each one is applied, request by request:

* speculative decoding keeps the KV of the accepted drafts and trims the rest
  (`spec_decode.apply`);
* a request with n > 1 whose prompt is done forks its n - 1 other completions
  (they share the prompt's blocks) and each appends its first token;
* every sequence appends its tokens (text, stop conditions, finishing:
  `engine._append_tokens`);
* a beam search whose live beams all have their next-token scores takes its
  beam step (`beam_search.step`), whichever step brought the last beam back.

A failure is contained to its request: unusable logits (the Choice's
`error`) or an exception while applying one request's tokens finish that
request with finish_reason "abort" and an `error` saying why, its blocks
released, and the step goes on for the others.
"""

from __future__ import annotations

from nanoserve import beam_search, spec_decode
from nanoserve.choose import Choice
from nanoserve.outputs import RequestOutput
from nanoserve.sequence import SequenceStatus


def commit(engine, chosen: list[Choice], outputs: dict[str, RequestOutput]) -> tuple[int, int]:
    """Apply the step's choices; returns (draft tokens verified, accepted)."""
    drafted = accepted = 0
    for choice in chosen:
        seq = choice.chunk.seq
        if seq.is_finished:        # (its request failed with an earlier choice of this step)
            continue
        try:
            if choice.error is not None:
                fail_request(engine, seq.group_id, choice.error, outputs)
            elif choice.beam_logprobs is not None:
                seq.beam_logprobs = choice.beam_logprobs
            else:
                if choice.chunk.draft_token_ids:
                    spec_decode.apply(engine, choice.chunk, choice.tokens, choice.num_accepted)
                    drafted += len(choice.chunk.draft_token_ids)
                    accepted += choice.num_accepted
                forks = []
                if choice.forks:   # n > 1: the prompt is done; the n sequences share its blocks
                    engine.groups[seq.group_id].forked, seq.seats = True, 1
                    forks = [(engine._fork_seq(seq, g), token) for g, token in choice.forks]
                outputs[seq.group_id] = engine._append_tokens(seq, choice.tokens)
                for fork, token in forks:
                    outputs[seq.group_id] = engine._append_tokens(fork, [token])
        except Exception as exc:   # noqa: BLE001 -- one request's failure must not stop the others
            fail_request(engine, seq.group_id, f"{type(exc).__name__}: {exc}", outputs)
    for group in [g for g in engine.groups.values() if g.is_beam_search and beam_search.ready(g)]:
        try:
            beam_search.step(engine, group, outputs)
        except Exception as exc:   # noqa: BLE001
            fail_request(engine, group.request_id, f"{type(exc).__name__}: {exc}", outputs)
    engine._spec_totals["drafted"] += drafted
    engine._spec_totals["accepted"] += accepted
    return drafted, accepted


def fail_request(engine, group_id: str, error: str, outputs: dict[str, RequestOutput]) -> None:
    """Finish every live sequence of a request with an error (finish_reason "abort", blocks released)."""
    group = engine.groups.get(group_id)
    for seq in group.live if group is not None else []:
        seq.error = f"step {engine.step_count}: {error}"
        outputs[group_id] = engine._finish(seq, SequenceStatus.FINISHED_ABORTED, delta="")
