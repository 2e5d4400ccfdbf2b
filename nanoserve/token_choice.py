"""Token choice: from one step's logits to each sequence's next token(s), changing no bookkeeping.

This is the last part of a step's *compute* phase (see `engine.py`): after
the forward, every chunk that reached its sequence's end gets a `Choice`:

* plain sampling: one token (`sampler.py`); a request with n > 1 whose prompt
  just finished also gets the first tokens of its n - 1 forks-to-be, drawn
  from the same logits row with their own RNGs (commit forks them);
* speculative decoding: the accepted drafts plus one (`spec_decode.decide`);
* beam search: the beam's next-token log-probs (`beam_search.next_logprobs`);
  the beams are chosen at commit, once every beam of the request has them;
* a row that is not a distribution (NaN or +inf anywhere, or nothing finite):
  an `error`, and commit fails that one request.

Structured output: a constrained sequence's grammar gives each of its rows a
token mask (`structured_output.py`), read from its matcher here and applied by
the sampler; a speculative step gets one mask per draft position. A grammar
that allows no token at all here (or only EOS before `min_tokens`) is an
`error` too: the request ends instead of waiting for a token that cannot come.

Nothing here touches a queue, a block table, a token list or a grammar's
matcher (masks are only read from it); only the requests' RNGs advance (`step_rollback.py` restores them if the step
fails), so a failure anywhere in the compute phase leaves nothing to undo
but the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoserve import beam_search, spec_decode, structured_output
from nanoserve.request_table import RequestTable
from nanoserve.runner import RunInput
from nanoserve.sampler import SampledToken, Sampler, SamplingRow
from nanoserve.scheduler import ScheduledChunk


@dataclass(slots=True)
class Choice:
    """What the compute phase chose for one chunk; the commit phase applies it."""

    chunk: ScheduledChunk
    tokens: list[SampledToken] = field(default_factory=list)   # plain: one; speculative: the Verdict's tokens
    verdict: spec_decode.Verdict | None = None                  # speculative: what the target made of the drafts
    forks: list[tuple[torch.Generator, SampledToken]] = field(default_factory=list)   # n > 1: (RNG, first token)
    beam_logprobs: torch.Tensor | None = None                   # beam search: log-probs [V]
    beam_mask: structured_output.MaskInfo | None = None         # ... and what the grammar's mask did to them
    error: str | None = None                                    # the logits were unusable: the request fails


def bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows] bool: rows with a NaN or +inf, or with no finite value (no distribution to draw from)."""
    # A row whose sum is finite has no NaN and no infinity at all: one cheap pass clears almost every row.
    # The rest (a -inf is allowed: a masked token) get the exact test.
    bad = ~logits.sum(-1).isfinite()
    suspects = bad.nonzero()[:, 0]
    if len(suspects):
        rows = logits[suspects]
        bad[suspects] = rows.isnan().any(-1) | rows.isposinf().any(-1) | ~rows.isfinite().any(-1)
    return bad


def choose_tokens(table: RequestTable, sampler: Sampler, verify: Callable, chunks: list[ScheduledChunk],
                  inputs: list[RunInput], logits: torch.Tensor, drafts: spec_decode.Drafts) -> list[Choice]:
    """One Choice per chunk that samples, in chunk order. `logits` rows follow the chunks' num_logits.

    The table is only read (each request's n and seed, the EOS id); `verify` is speculative decoding's
    acceptance rule (`Components.verify`)."""
    eos = table.eos_token_id
    bad = bad_rows(logits).tolist()
    choices, plain, row = [], [], 0
    for chunk, x in zip(chunks, inputs):
        if not x.num_logits:
            continue
        rows = range(row, row + x.num_logits)
        row += x.num_logits
        choice = Choice(chunk)
        choices.append(choice)
        seq = chunk.seq
        masks = _grammar_masks(chunk, eos) if seq.grammar is not None else None   # [num_logits, W]
        if any(bad[r] for r in rows):
            choice.error = (f"the model's logits for {seq.seq_id} at position {seq.num_tokens} are not a "
                            "distribution (NaN or infinite values); the request was stopped")
        elif masks is not None and masks is DEAD_END:
            choice.error = (f"structured output: the {seq.grammar.kind} grammar allows no token at output "
                            f"position {seq.num_output_tokens}" + (f" (only EOS, which min_tokens="
                            f"{seq.params.min_tokens} forbids)" if seq.num_output_tokens < seq.params.min_tokens
                            else "") + "; the request was stopped")
        elif chunk.draft_token_ids:
            verdict = spec_decode.decide(chunk, logits[rows.start:rows.stop], drafts.q.get(seq.seq_id),
                                         sampler, verify, eos, masks)
            choice.verdict, choice.tokens = verdict, verdict.tokens
        elif seq.params.use_beam_search:
            mask = masks[0] if masks is not None else None
            choice.beam_logprobs = beam_search.next_logprobs(logits[rows.start], seq, eos, mask)
            if mask is not None:
                choice.beam_mask = structured_output.mask_info(logits[rows.start:rows.start + 1], mask[None])[0]
        else:
            plain.append((choice, rows.start, masks[0] if masks is not None else None))
    if plain:
        _sample(table, sampler, plain, logits)
    return choices


DEAD_END = torch.empty(0, dtype=torch.int32)   # _grammar_masks: the grammar allows nothing here


def _grammar_masks(chunk: ScheduledChunk, eos_token_id: int | None) -> torch.Tensor:
    """The grammar's mask for each logits row of a constrained chunk [num_logits, W] (one row, or one per
    draft position and the bonus), or DEAD_END when the current position allows no token the sampler may
    draw. A later draft position that is a dead end allows everything instead: the matcher refuses
    whatever is drawn there at commit, and the request fails then."""
    seq = chunk.seq
    grammar = seq.grammar
    masks = grammar.draft_masks(chunk.draft_token_ids) if chunk.draft_token_ids else grammar.next_mask()[None]
    # Before min_tokens, EOS and stop_token_ids are forbidden too: a mask of nothing else is empty.
    for i in range(len(masks)):
        banned = set(seq.params.stop_token_ids) | {eos_token_id} \
            if seq.num_output_tokens + i < seq.params.min_tokens else set()
        if structured_output.allows_nothing(masks[i], grammar.vocab_size, banned):
            if i == 0:
                return DEAD_END
            masks[i:] = -1
            break
    return masks


def _sample(table: RequestTable, sampler: Sampler, plain: list[tuple[Choice, int, torch.Tensor | None]],
            logits: torch.Tensor) -> None:
    """One token per plain chunk, in one batched call; n > 1 requests also draw for their forks-to-be."""
    pairs = []   # (choice, fork seed or None, RNG, logits row, grammar mask or None)
    for choice, r, mask in plain:
        seq = choice.chunk.seq
        pairs.append((choice, None, seq.generator, r, mask))
        request = table.requests[seq.request_id]
        if request.needs_fork:   # the n sequences share the prompt (and the grammar's state): the same row
            for i in range(1, request.params.n):
                seed = (request.seed * 1_000_003 + i) % 2**62
                pairs.append((choice, seed, torch.Generator().manual_seed(seed), r, mask))
    rows = [SamplingRow(c.chunk.seq.params, c.chunk.seq.prompt_token_ids, c.chunk.seq.output_token_ids, g,
                        table.eos_token_id, mask) for c, _, g, _, mask in pairs]
    sampled = sampler(logits[[p[3] for p in pairs]], rows)
    for (choice, seed, g, _, _), token in zip(pairs, sampled):
        if seed is None:
            choice.tokens = [token]
        else:
            choice.forks.append((g, token))
