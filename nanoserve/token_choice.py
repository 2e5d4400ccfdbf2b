"""Token choice: from one step's logits to each sequence's next token(s), changing no bookkeeping.

This is the last part of a step's *compute* phase (see `engine.py`): after
the forward, every chunk that reached its sequence's end gets a `Choice`:

* plain sampling: one token (`sampler.py`); a request with n > 1 whose prompt
  just finished also gets the first tokens of its n - 1 forks-to-be, drawn
  from the same logits row with their own RNGs (the engine forks at commit);
* speculative decoding: the accepted drafts plus one (`spec_decode.decide`);
* beam search: the beam's next-token log-probs (`beam_search.next_logprobs`);
  the beams are chosen at commit, once every beam of the request has them;
* a row that is not a distribution (NaN or +inf anywhere, or nothing finite):
  an `error`, and the engine fails that one request at commit.

Nothing here touches a queue, a block table or a token list; only the
requests' RNGs advance (the engine saves and restores them if the step
fails), so a failure anywhere in the compute phase leaves nothing to undo
but the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoserve import beam_search, spec_decode
from nanoserve.runner import RunInput
from nanoserve.sampler import SampledToken, SamplingRow
from nanoserve.scheduler import ScheduledChunk

if TYPE_CHECKING:                      # (a type only: engine.py imports this module)
    from nanoserve.engine import LLMEngine


@dataclass(slots=True)
class Choice:
    """What the compute phase chose for one chunk; the commit phase applies it."""

    chunk: ScheduledChunk
    tokens: list[SampledToken] = field(default_factory=list)   # plain: one; speculative: the Verdict's tokens
    verdict: spec_decode.Verdict | None = None                  # speculative: what the target made of the drafts
    forks: list[tuple[torch.Generator, SampledToken]] = field(default_factory=list)   # n > 1: (RNG, first token)
    beam_logprobs: torch.Tensor | None = None                   # beam search: log-probs [V]
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


def choose_tokens(engine: LLMEngine, chunks: list[ScheduledChunk], inputs: list[RunInput], logits: torch.Tensor,
           drafts: spec_decode.Drafts) -> list[Choice]:
    """One Choice per chunk that samples, in chunk order. `logits` rows follow the chunks' num_logits."""
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
        if any(bad[r] for r in rows):
            choice.error = (f"the model's logits for {seq.seq_id} at position {seq.num_tokens} are not a "
                            "distribution (NaN or infinite values); the request was stopped")
        elif chunk.draft_token_ids:
            verdict = spec_decode.decide(chunk, logits[rows.start:rows.stop], drafts.q.get(seq.seq_id),
                                         engine.sampler, engine.components.verify, engine.eos_token_id)
            choice.verdict, choice.tokens = verdict, verdict.tokens
        elif seq.params.use_beam_search:
            choice.beam_logprobs = beam_search.next_logprobs(logits[rows.start], seq, engine.eos_token_id)
        else:
            plain.append((choice, rows.start))
    if plain:
        _sample(engine, plain, logits)
    return choices


def _sample(engine: LLMEngine, plain: list[tuple[Choice, int]], logits: torch.Tensor) -> None:
    """One token per plain chunk, in one batched call; n > 1 requests also draw for their forks-to-be."""
    pairs = []   # (choice, fork seed or None, RNG, logits row)
    for choice, r in plain:
        seq = choice.chunk.seq
        pairs.append((choice, None, seq.generator, r))
        request = engine.requests[seq.request_id]
        if request.needs_fork:   # the n sequences share the prompt and sample from the same row
            for i in range(1, request.params.n):
                seed = (request.seed * 1_000_003 + i) % 2**62
                pairs.append((choice, seed, torch.Generator().manual_seed(seed), r))
    rows = [SamplingRow(c.chunk.seq.params, c.chunk.seq.prompt_token_ids, c.chunk.seq.output_token_ids, g,
                        engine.eos_token_id) for c, _, g, _ in pairs]
    sampled = engine.sampler(logits[[r for *_, r in pairs]], rows)
    for (choice, seed, g, _), token in zip(pairs, sampled):
        if seed is None:
            choice.tokens = [token]
        else:
            choice.forks.append((g, token))
