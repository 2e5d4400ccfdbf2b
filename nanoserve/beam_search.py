"""Beam search: keep the k most likely continuations, built on copy-on-write fork.

Each beam is a sequence. After a step in which every live beam of a request
got its next-token log-probs, the candidates are all (beam, token) pairs,
scored by the beam's cumulative log-prob plus the token's:

    scores = [beam.cumulative_logprob + logprobs[beam] for beam in live]   # [beams, V]
    take the 2k best, best first:
        an EOS candidate among the first k ends a hypothesis (a finished beam)
        any other continues, until k continue

A beam chosen once continues itself; chosen twice, it is *forked* first (the
new beam shares all its blocks, and the first write into the shared last
block copies it); not chosen at all, it is *pruned* and its blocks freed.
That is Hugging Face's `generate(num_beams=k, do_sample=False)`, with its
`early_stopping=False` rule for when to stop early, and scores
`cumulative_logprob / num_output_tokens ** length_penalty` for ranking the
finished hypotheses.

This module only chooses (`decide` returns a `BeamStep`); the engine
applies it: forks, prunes and appends (`commit.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoserve import structured_output
from nanoserve.sampler import SampledToken
from nanoserve.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class Candidate:
    beam: Sequence        # the beam it extends
    token_id: int
    logprob: float        # the token's log-prob under that beam
    score: float          # beam.cumulative_logprob + logprob


def next_logprobs(logits: torch.Tensor, seq: Sequence, eos_token_id: int | None,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax of one row of logits [V]; ending tokens get -inf before min_tokens (HF: min_new_tokens),
    and so do the tokens a structured output's grammar forbids (`mask` [W], as HF's prefix_allowed_tokens_fn:
    the allowed tokens keep their log-probs, not renormalised)."""
    logprobs = logits.float().log_softmax(dim=-1)
    if seq.num_output_tokens < seq.params.min_tokens:
        ends = list(seq.params.stop_token_ids)
        if eos_token_id is not None and not seq.params.ignore_eos:
            ends.append(eos_token_id)
        if ends:
            logprobs[ends] = -math.inf
    if mask is not None:
        logprobs = structured_output.apply_masks(logprobs[None], mask[None], [0])[0]
    return logprobs


def select(beams: list[Sequence], width: int, end_ids: set[int]) -> tuple[list[Candidate], list[Candidate]]:
    """The candidates that continue (at most `width`) and those that end a hypothesis, best first."""
    vocab = beams[0].beam_logprobs.numel()
    scores = torch.stack([b.beam_logprobs + b.cumulative_logprob for b in beams]).view(-1)   # [beams * V]
    values, indices = scores.topk(min(2 * width, scores.numel()))
    keep: list[Candidate] = []
    ended: list[Candidate] = []
    for rank, (score, i) in enumerate(zip(values.tolist(), indices.tolist())):
        if score == -math.inf or len(keep) == width:
            break
        beam, token = beams[i // vocab], i % vocab
        c = Candidate(beam, token, float(beam.beam_logprobs[token]), score)
        if token in end_ids:
            if rank < width:          # Hugging Face: only an ending among the k best counts
                ended.append(c)
        else:
            keep.append(c)
    return keep, ended


def score(seq: Sequence, length_penalty: float) -> float:
    """How a finished beam ranks: its cumulative log-prob, normalised by its length."""
    return seq.cumulative_logprob / max(1, seq.num_output_tokens) ** length_penalty


def is_done(finished: list[Sequence], live: list[Sequence], width: int, length_penalty: float) -> bool:
    """HF's early_stopping=False rule: k hypotheses are in and no live beam's current score beats the worst."""
    if len(finished) < width or not live:
        return not live
    worst = sorted((score(s, length_penalty) for s in finished), reverse=True)[width - 1]
    best_live = max(score(s, length_penalty) for s in live)
    return worst >= best_live


def ranked(seqs: list[Sequence], length_penalty: float) -> list[Sequence]:
    """Best first."""
    return sorted(seqs, key=lambda s: score(s, length_penalty), reverse=True)


def ready(request) -> bool:
    """Can `request` take its beam step? Every live beam is running and has its next-token scores.

    A beam that was preempted waits to be readmitted (and, after recompute, to have its
    scores again), so that forks always share real blocks of a running parent.
    """
    live = request.live
    return bool(live) and all(s.status is SequenceStatus.RUNNING and s.beam_logprobs is not None for s in live)


@dataclass(slots=True)
class BeamStep:
    """What one beam step of a request decided, in candidate order; the engine applies it (`commit.py`).

    Each continuation appends `token` to `beam` itself, or (`fork`) to a new fork of `beam`
    made first; `pruned` beams were chosen for nothing and are dropped.
    """

    continuations: list[tuple[Sequence, SampledToken, bool]]   # (beam, its next token, fork it first?)
    pruned: list[Sequence]


def decide(request, free_seats: int, eos_token_id: int | None) -> BeamStep:
    """Every live beam of `request` has its next-token scores: keep the best continuations.

    At most as many beams continue as the request has seats: its own, plus `free_seats`
    (after a user aborted one beam, its seat may have gone to another request).
    Changes nothing: the engine forks, prunes and appends what this returns.
    """
    live = request.live
    params = request.params
    end_ids = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        end_ids.add(eos_token_id)
    keep, ended = select(live, min(params.beam_width, free_seats + sum(s.seats for s in live)), end_ids)
    continuations, used = [], set()
    for c in keep:
        fork = c.beam.seq_id in used   # a beam's first continuation is the beam itself, a second one a fork
        used.add(c.beam.seq_id)
        continuations.append((c.beam, _token(c), fork))
    continuations += [(c.beam, _token(c), True) for c in ended]   # an ended hypothesis: a fork that finishes now
    return BeamStep(continuations, [s for s in live if s.seq_id not in used])


def finished_early(request) -> list[Sequence]:
    """After a beam step: the live beams to drop because none of them can beat the finished ones."""
    live = request.live
    params = request.params
    if live and is_done([s for s in request.seqs if s.is_finished], live, params.beam_width, params.length_penalty):
        return live
    return []


def _token(c: Candidate) -> SampledToken:
    """The chosen token with its log-prob (and the top log-probs, if the request asked)."""
    top = None
    if c.beam.params.logprobs is not None:
        n = c.beam.params.logprobs
        vals, ids = c.beam.beam_logprobs.topk(n) if n else (torch.empty(0), torch.empty(0))
        top = dict(zip(ids.tolist(), vals.tolist()))
        top[c.token_id] = c.logprob
    return SampledToken(c.token_id, c.logprob, top, c.beam.beam_mask)
