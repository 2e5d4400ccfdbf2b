"""Sampler: turn one row of logits per sequence into the next token.

This module owns everything between the model's last-position logits and the
chosen token id: penalties, the min_tokens mask, the structured-output mask,
temperature, top-k, top-p, min-p, the random draw, and the log-probabilities
reported back. It does not decide when a sequence stops (the engine checks
EOS, stop strings and max_tokens) and it does not create the per-request RNGs
(the engine makes one `torch.Generator` per seeded request and passes it in
every step).

The pipeline, for logits of shape [B, V] (B sequences, vocabulary V):

    raw logits --penalties--> --min_tokens mask--> --grammar mask--> processed logits
        greedy rows (temperature 0): argmax(processed)
        sampled rows: /temperature -> top-k -> top-p -> min-p -> softmax -> draw

Each step is a module-level function that returns a new tensor, so the
speculative decoder can rebuild the exact target distribution with `probs`.
The grammar mask (structured output: a row's `token_bitmask`, filled from its
sequence's grammar by `token_choice.py`) comes before temperature and the
truncations, so a constrained row draws from the model's distribution
restricted to the allowed tokens and renormalised.

Work is vectorised over the batch. The draw (`inverse_cdf`) takes one uniform
number per row, and only those numbers are made row by row, because every
seeded row takes its number from its own generator. That is what makes a
seeded request give the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoserve import structured_output
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_output import MaskInfo

FLOAT32 = torch.finfo(torch.float32)   # the sampler works in float32


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence in the batch."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]     # the prompt (repetition_penalty looks here too)
    output_token_ids: Sequence[int]     # tokens generated so far (all penalties look here)
    generator: torch.Generator | None   # per-request RNG; None draws from torch's default RNG
    eos_token_id: int | None            # the model's EOS, masked while output is shorter than min_tokens
    token_bitmask: torch.Tensor | None = None   # structured output: [ceil(V/32)] int32, bit t set = t allowed


@dataclass(slots=True)
class SampledToken:
    token_id: int                           # the chosen token
    logprob: float                          # its log-prob under the raw model distribution
    top_logprobs: dict[int, float] | None   # params.logprobs best raw log-probs, plus the chosen one
    mask: MaskInfo | None = None            # structured output: what the grammar's mask did at this position


def _column(rows: Sequence[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    """One SamplingParams field for every row, as a float32 column [B, 1]."""
    values = [float(getattr(r.params, name)) for r in rows]
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How many times each token occurs in each row's list: [B, V] float32."""
    max_len = max((len(ids) for ids in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad ragged lists with an extra column V that we throw away afterwards.
    padded = [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_lists]
    index = torch.tensor(padded, dtype=torch.long, device=device)  # [B, L]
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (HF), then frequency and presence (OpenAI) penalties. Returns a new [B, V] tensor."""
    B, V = logits.shape
    if all(r.params.repetition_penalty == 1.0 and r.params.presence_penalty == 0.0
           and r.params.frequency_penalty == 0.0 for r in rows):
        return logits  # fast path: nothing to do
    out_counts = _token_counts([r.output_token_ids for r in rows], V, logits.device)  # [B, V]

    if any(r.params.repetition_penalty != 1.0 for r in rows):
        # A token is "seen" if it is anywhere in the prompt or the output.
        seen = (_token_counts([r.prompt_token_ids for r in rows], V, logits.device) + out_counts) > 0
        # (clamped into float32's finite range: 5e-324 is a valid penalty, and 0 in float32)
        rep = _column(rows, "repetition_penalty", logits.device).clamp(FLOAT32.tiny, FLOAT32.max)   # [B, 1]
        # Push seen tokens towards "less likely": shrink positive logits, grow negative ones.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        # An extreme penalty overflows: a seen token becomes as likely as float32 allows, never +inf
        # (softmax has no answer for +inf).
        logits = torch.where(seen, penalised, logits).clamp(max=FLOAT32.max)

    freq = _column(rows, "frequency_penalty", logits.device)           # [B, 1]
    pres = _column(rows, "presence_penalty", logits.device)            # [B, 1]
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Forbid EOS and stop_token_ids (-inf) for rows that have not yet made min_tokens tokens."""
    row_idx, tok_idx = [], []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) >= r.params.min_tokens:
            continue
        banned = list(r.params.stop_token_ids)
        if r.eos_token_id is not None:
            banned.append(r.eos_token_id)  # masked even with ignore_eos: it is a no-op then anyway
        row_idx += [i] * len(banned)
        tok_idx += banned
    if not row_idx:
        return logits
    logits = logits.clone()
    logits[torch.tensor(row_idx, device=logits.device), torch.tensor(tok_idx, device=logits.device)] = float("-inf")
    return logits


def apply_temperature(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Divide each row by its temperature. Greedy rows (temperature 0) are left as they are.

    The row's maximum is subtracted first: softmax gives the same distribution, and a tiny
    temperature (1e-30, or 5e-324, which is 0 in float32) then sends the other logits towards
    -inf (the distribution tends to the argmax), instead of the maximum towards +inf (NaN)."""
    temp = _column(rows, "temperature", logits.device)                 # [B, 1]
    greedy = torch.tensor([[r.params.greedy] for r in rows], device=logits.device)
    temp = torch.where(greedy, torch.ones_like(temp), temp.clamp(min=FLOAT32.tiny))
    top = logits.max(dim=-1, keepdim=True).values                      # [B, 1]
    return (logits - torch.where(top.isfinite(), top, torch.zeros_like(top))).div_(temp)   # one new tensor


def apply_top_k_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Keep the top_k largest logits, then the nucleus of mass top_p among them; -inf the rest."""
    B, V = logits.shape
    ks = [r.params.top_k if 0 < r.params.top_k < V else V for r in rows]
    ps = [r.params.top_p for r in rows]
    if all(k == V for k in ks) and all(p == 1.0 for p in ps):
        return logits  # fast path: no sort
    sorted_logits, order = logits.sort(dim=-1, descending=True)        # both [B, V]

    # top-k: everything strictly below the k-th largest value goes (ties with it stay).
    k = torch.tensor(ks, dtype=torch.long, device=logits.device).unsqueeze(1)  # [B, 1]
    kth = sorted_logits.gather(1, k - 1)                                # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

    # top-p on what top-k left, renormalised: keep a token while the mass of the
    # tokens before it is still below top_p. The token that crosses is kept, and
    # so is the first one (mass before it is 0).
    sorted_probs = sorted_logits.softmax(dim=-1)                        # [B, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs            # [B, V]
    p = torch.tensor(ps, dtype=torch.float32, device=logits.device).unsqueeze(1)  # [B, 1]
    drop = (mass_before >= p) & (p < 1.0)   # top_p == 1 never drops (guards against rounding)
    drop[:, 0] = False                       # the most likely token stays, even when top_p is 0 in float32
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    # Undo the sort: position j of the sorted row goes back to column order[j].
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if all(r.params.min_p == 0.0 for r in rows):
        return logits
    min_p = _column(rows, "min_p", logits.device)                      # [B, 1]
    probs = logits.softmax(dim=-1)                                      # [B, V]
    top = probs.max(dim=-1, keepdim=True).values                        # [B, 1]
    return logits.masked_fill(probs < min_p * top, float("-inf"))


def apply_grammar(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Structured output: -inf for every token a row's grammar forbids (rows without one unchanged)."""
    masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    if not masked:
        return logits
    return structured_output.apply_masks(logits, torch.stack([rows[i].token_bitmask for i in masked]), masked)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Raw logits -> penalised and masked float32 logits [B, V]. Greedy rows take argmax of this."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), "logits must be [B, V], one row per SamplingRow"
    # No step below writes in place (each returns a new tensor or its input unchanged),
    # so the caller's logits are never touched and the common case copies nothing.
    return apply_grammar(apply_min_tokens(apply_penalties(logits.float(), rows), rows), rows)


def _target_probs(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Processed logits [B, V] -> the distribution each row draws from [B, V]."""
    greedy = torch.tensor([r.params.greedy for r in rows], dtype=torch.bool, device=processed.device)
    if bool(greedy.all()):
        return torch.nn.functional.one_hot(processed.argmax(dim=-1), processed.shape[-1]).float()
    x = apply_temperature(processed, rows)
    x = apply_top_k_top_p(x, rows)
    x = apply_min_p(x, rows)
    p = x.softmax(dim=-1)                                               # [B, V]
    if bool(greedy.any()):
        one_hot = torch.nn.functional.one_hot(processed.argmax(dim=-1), processed.shape[-1]).float()
        p = torch.where(greedy.unsqueeze(1), one_hot, p)
    return p


def probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The exact distribution [B, V] float32 the sampler draws from (one-hot for greedy rows)."""
    return _target_probs(process_logits(logits, rows), rows)


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of p [R, V] from uniform numbers u [R] in [0, 1): [R] long.

    Inverse transform sampling: the token whose share of the running sum of p covers u (the first
    token whose cumulative probability exceeds u times the row's total). Each token is drawn with
    exactly its probability, and one of probability 0 never is (its cumulative sum equals the one
    before it). It needs one uniform number a row where `torch.multinomial` makes one random number
    per token (49 152 of them a row for SmolLM2): 32 rows took 33 ms a step with multinomial, 2 ms
    this way, on one CPU core."""
    c = p.cumsum(dim=-1)                                                # [R, V]
    target = (u.to(c.device, c.dtype) * c[:, -1]).unsqueeze(1)          # [R, 1], below the row's total
    return torch.searchsorted(c, target, right=True).squeeze(1).clamp_(max=p.shape[-1] - 1)


def draw(p: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row from distributions p [B, V]: [B] long, by `inverse_cdf`.

    A greedy row's p is one-hot, so whatever its uniform number, it gets its argmax (it takes 0 and uses
    no randomness). Unseeded rows share torch's default RNG, one call for all of them; a seeded row takes
    its number from its own generator, on the generator's device.
    """
    u = torch.zeros(len(rows))
    shared = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared))
    for i, r in enumerate(rows):
        if not r.params.greedy and r.generator is not None:
            u[i] = torch.rand(1, generator=r.generator, device=r.generator.device).item()
    return inverse_cdf(p, u)


def _pick(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row from processed logits [B, V]: [B] long.

    Greedy rows take the argmax directly (no distribution is built for them);
    the other rows draw from their target distribution.
    """
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled) == len(rows):                                       # every row draws: no copy, no argmax
        return draw(_target_probs(processed, rows), rows)
    tokens = processed.argmax(dim=-1)                                   # [B], right for greedy rows
    if sampled:
        sampled_rows = [rows[i] for i in sampled]
        tokens[sampled] = draw(_target_probs(processed[sampled], sampled_rows), sampled_rows)
    return tokens


class Sampler:
    """Chooses one token per row and reports its raw log-probability."""

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        return probs(logits, rows)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        if len(rows) == 0:
            return []
        tokens = _pick(process_logits(logits, rows), rows)            # [B]
        return self.report(logits, tokens.tolist(), rows)

    def report(self, logits: torch.Tensor, token_ids: list[int], rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Wrap chosen tokens with their log-probs under the raw model, before any processing."""
        raw_logprobs = logits.float().log_softmax(dim=-1)               # [B, V]
        index = torch.tensor(token_ids, device=logits.device).unsqueeze(1)
        chosen = raw_logprobs.gather(1, index).squeeze(1).tolist()

        wanted = [r.params.logprobs for r in rows if r.params.logprobs]
        top_vals, top_ids = [], []
        if wanted:  # one topk for the whole batch, at the largest count anyone asked for
            k = min(max(wanted), raw_logprobs.shape[-1])
            vals, ids = raw_logprobs.topk(k, dim=-1)                    # both [B, k]
            top_vals, top_ids = vals.tolist(), ids.tolist()

        masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        infos = dict(zip(masked, structured_output.mask_info(
            logits[masked], torch.stack([rows[i].token_bitmask for i in masked])))) if masked else {}
        out = []
        for i, r in enumerate(rows):
            top = None
            if r.params.logprobs is not None:
                n = r.params.logprobs
                top = dict(zip(top_ids[i][:n], top_vals[i][:n])) if n else {}
                top[token_ids[i]] = chosen[i]
            out.append(SampledToken(token_ids[i], chosen[i], top, infos.get(i)))
        return out
