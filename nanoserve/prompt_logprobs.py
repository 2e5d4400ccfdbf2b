"""Prompt log-probabilities: how likely the model found each token of the prompt.

`SamplingParams(prompt_logprobs=k)` asks, for every prompt token i >= 1, for
log p(prompt[i] | prompt[:i]) and the k most likely tokens at that position
(vLLM's `prompt_logprobs`). They are what an evaluation harness's
loglikelihood tasks and a perplexity measurement read. Token 0 has no context:
its entry is None.

They come from the prefill's own forward pass, nothing is run twice. The
logits of position p predict token p + 1, so a chunk computing positions
[start, start + n) can give the entries start + 1 .. start + n that lie inside
the prompt:

    prompt      t0    t1    t2    t3    t4 | first output token
    position    0     1     2     3     4
    logits row  ->t1  ->t2  ->t3  ->t4  ->sample
    entry       None  e1    e2    e3    e4

The runner returns logits only for the last `num_logits` rows of each chunk
(`RunInput`); sampling wants one. During the compute phase `widen` asks for
the rows whose entries the sequence still lacks and `take` turns them into
entries (stored on the chunk) and hands back exactly the rows sampling asked
for, so `token_choice.py` never knows. At commit `commit` appends the entries to the
sequence: a failed step drops its plan and with it the entries, like any other
work of that step.

Three cases keep the entries contiguous:

* chunked prefill: each chunk adds the entries of its own positions, so the
  numbers equal those of one whole-prompt chunk (the tests check it);
* preemption by recompute: the prompt runs again, and only rows past the
  entries already recorded are asked for;
* the prefix cache: a hit would skip the very positions whose logits are
  needed, so a sequence whose entries are incomplete does not look up the cache
  (`KVManager.match`); its blocks still enter the cache for later requests.
  (vLLM makes the same choice.) `check_invariants` checks the entries cover
  every computed prompt position.

Log-probabilities are of the raw model distribution (before penalties,
temperature or top-k), as `SampledToken.logprob` is.
"""

from __future__ import annotations

import torch

from nanoserve.runner import RunInput
from nanoserve.scheduler import ScheduledChunk


def _first_position(chunk: ScheduledChunk) -> int | None:
    """The first position of `chunk` whose logits give a missing entry, or None if it gives none."""
    seq = chunk.seq
    if not seq.needs_prompt_logprobs:
        return None
    have = len(seq.prompt_logprobs)                     # entries 0 .. have - 1 exist
    first = max(chunk.start, have - 1)                  # position have - 1 gives entry `have`
    end = min(chunk.start + chunk.num_real_tokens, seq.num_prompt_tokens - 1)   # positions < end give entries
    return first if first < end else None


def widen(chunks: list[ScheduledChunk], inputs: list[RunInput]) -> list[RunInput]:
    """`inputs`, with more logits rows where a chunk gives prompt log-probabilities (`inputs` itself if none)."""
    wide = list(inputs)
    for i, (chunk, x) in enumerate(zip(chunks, inputs)):
        first = _first_position(chunk)
        if first is not None:       # every row from `first` to the chunk's end (sampling's last row included)
            rows = chunk.start + len(x.token_ids) - first
            wide[i] = RunInput(x.token_ids, x.start, x.block_table, max(rows, x.num_logits), x.group_tables)
    return inputs if all(w is x for w, x in zip(wide, inputs)) else wide


def take(chunks: list[ScheduledChunk], inputs: list[RunInput], wide: list[RunInput],
         logits: torch.Tensor) -> torch.Tensor:
    """Entries from the extra rows onto their chunks; returns the rows `inputs` asked for, in order.

    `logits` [sum of wide num_logits, V] follows `wide`; the result [sum of inputs' num_logits, V].
    """
    if wide is inputs:
        return logits
    keep: list[int] = []            # rows of `logits` that sampling wants
    row = 0
    for chunk, x, w in zip(chunks, inputs, wide):
        if w is not x:
            seq = chunk.seq
            first = chunk.start + len(x.token_ids) - w.num_logits          # the position of this block's row 0
            end = min(chunk.start + chunk.num_real_tokens, seq.num_prompt_tokens - 1)
            targets = seq.prompt_token_ids[first + 1 : end + 1]            # the tokens these rows predict
            chunk.prompt_logprobs = entries(logits[row : row + len(targets)], targets, seq.params.prompt_logprobs)
        keep.extend(range(row + w.num_logits - x.num_logits, row + w.num_logits))
        row += w.num_logits
    return logits[keep]


def entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """Per row of logits [R, V]: {the k most likely tokens and the target token: raw log-probability}."""
    logprobs = logits.float().log_softmax(dim=-1)                                           # [R, V]
    index = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)     # [R, 1]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    top_vals, top_ids = [[]] * len(targets), [[]] * len(targets)
    if k:
        vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)                     # both [R, k]
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for target, lp, ids, vals in zip(targets, chosen, top_ids, top_vals):
        entry = dict(zip(ids, vals))
        entry[target] = lp
        out.append(entry)
    return out


def commit(chunks: list[ScheduledChunk]) -> None:
    """After the forward: each chunk's entries join its sequence (the step is committed)."""
    for chunk in chunks:
        if chunk.prompt_logprobs:
            chunk.seq.prompt_logprobs.extend(chunk.prompt_logprobs)
