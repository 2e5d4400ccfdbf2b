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

This module only chooses; the engine forks, appends and prunes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoserve.sequence import Sequence


@dataclass(slots=True)
class Candidate:
    beam: Sequence        # the beam it extends
    token_id: int
    logprob: float        # the token's log-prob under that beam
    score: float          # beam.cumulative_logprob + logprob


def next_logprobs(logits: torch.Tensor, seq: Sequence, eos_token_id: int | None) -> torch.Tensor:
    """log_softmax of one row of logits [V]; ending tokens get -inf before min_tokens (HF: min_new_tokens)."""
    logprobs = logits.float().log_softmax(dim=-1)
    if seq.num_output_tokens < seq.params.min_tokens:
        ends = list(seq.params.stop_token_ids)
        if eos_token_id is not None and not seq.params.ignore_eos:
            ends.append(eos_token_id)
        if ends:
            logprobs[ends] = -math.inf
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
