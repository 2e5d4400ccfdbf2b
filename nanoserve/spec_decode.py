"""Speculative decoding: cheap guesses, checked exactly by the target model.

Decoding is one forward pass per token, and at small batch sizes a forward
pass costs about the same for 1 token as for 5: reading the weights dominates.
So a cheap *proposer* guesses k tokens, and the target model scores all of
them (plus one more position) in a single forward over the paged KV. The
rejection rule below keeps the output distribution exactly that of plain
sampling from the target:

    for i, x in enumerate(draft):                  p, q: target and draft distributions
        accept x with probability min(1, p_i(x) / q_i(x))
        on the first rejection: emit a token from normalise(max(0, p_i - q_i)); stop
    if all k were accepted: emit a bonus token from p_k

p and q are the *full* distributions after identical processing (penalties,
temperature, top-k, top-p, min-p: `sampler.probs`). With structured output, p
at each position is masked by the grammar as it stands after the drafts before
it (`structured_output.SequenceGrammar.draft_masks`), so the output is exactly
masked sampling's; q may ignore the grammar (the rule is exact for any q). For an n-gram draft q is
one-hot at x, so the residual is p with x removed. Greedy requests accept
while the draft equals the target's argmax and then emit the argmax.
This is the rule of Leviathan et al. (2023, arXiv:2211.17192) and Chen et
al. (2023, arXiv:2302.01318). A residual that scales q by p(x)/q(x), as in
max(0, p - q * p(x)/q(x)), is a tempting mistake: lesson 2 computes why it
is not exact.

Two proposers share one interface, `propose(seqs, limits) -> Drafts`:

* `NgramProposer`       prompt lookup: find the longest suffix of the request's
                        own tokens (n in [ngram_min, ngram_max]) that occurred
                        before, and propose the k tokens that followed it
* `DraftModelProposer`  a small model (another checkpoint with the same
                        vocabulary, or the target's first few layers) with its
                        own block pool and paged KV cache, sampling k tokens

The engine schedules the drafts and runs the forward; this module owns
proposing and the acceptance rule, and changes none of the engine's
bookkeeping (only the draft model's own cache and the sequences' RNGs advance):
`propose` before scheduling returns the `Drafts`, `decide` after the forward
returns a `Verdict` (which tokens are accepted), and the engine applies it
when the step commits (`commit.py`: append the tokens, trim the KV written
for rejected positions).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from nanoserve.block_pool import BlockPool
from nanoserve.implementation import Choice, choose
from nanoserve.runner import ModelRunner, RunInput
from nanoserve.sampler import SampledToken, SamplingRow, draw, probs
from nanoserve.sequence import Sequence


@dataclass(slots=True)
class Drafts:
    """What a proposer guessed: tokens per sequence, and q (None for one-hot n-gram drafts)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    q: dict[str, torch.Tensor] = field(default_factory=dict)   # sequence id -> [len(tokens), V]
    num_tokens: dict[str, int] = field(default_factory=dict)   # sequence id -> its length when drafted
                                                               # (filled by `propose` below, not by proposers)


def sampling_rows(seq: Sequence, draft: list[int], eos: int | None, n: int,
                  masks: torch.Tensor | None = None) -> list[SamplingRow]:
    """Rows for positions 0..n-1 of a speculative step: position i has seen draft[:i] (and with
    structured output, masks[i] is its grammar's mask after draft[:i])."""
    return [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids + draft[:i], seq.generator, eos,
                        masks[i] if masks is not None else None)
            for i in range(n)]


# -- the acceptance rule ------------------------------------------------------------------


def verify(p: torch.Tensor, draft: list[int], q: torch.Tensor | None, greedy: bool,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """Check `draft` against target distributions p [len(draft) + 1, V].

    q is [len(draft), V], or None for a one-hot (n-gram) draft.
    Returns (tokens to append: the accepted drafts plus one corrected or bonus token, number accepted).
    """
    p = p.cpu()
    q = q.cpu() if q is not None else None
    for i, x in enumerate(draft):
        if greedy:
            if x == int(p[i].argmax()):
                continue
            return draft[:i] + [int(p[i].argmax())], i
        q_x = float(q[i, x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if u * q_x < float(p[i, x]):          # u < p(x) / q(x): accept with probability min(1, p/q)
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp_min(0.0)
        else:                                 # q one-hot at x: max(0, p - q) is p without x
            residual = p[i].clone()
            residual[x] = 0.0
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return draft[:i] + [token], i
    n = len(draft)
    bonus = int(p[n].argmax()) if greedy else int(torch.multinomial(p[n], 1, generator=generator))
    return draft + [bonus], n


# -- proposers ------------------------------------------------------------------------------


class NgramProposer:
    """Prompt lookup: reuse what followed an earlier occurrence of the current suffix."""

    method = "ngram"

    def __init__(self, k: int, ngram_min: int, ngram_max: int) -> None:
        self.k, self.ngram_min, self.ngram_max = k, ngram_min, ngram_max

    def propose(self, seqs: list[Sequence], limits: dict[str, int]) -> Drafts:
        drafts = Drafts()
        for seq in seqs:
            tokens = ngram_lookup(seq.all_token_ids, self.ngram_min, self.ngram_max, limits[seq.seq_id])
            if tokens:
                drafts.tokens[seq.seq_id] = tokens
        return drafts

    def accepted(self, seq: Sequence, num_tokens_before: int, num_accepted: int) -> None:
        pass   # no state: every step looks the tokens up afresh

    def release(self, seq_id: str) -> None:
        pass

    def check_invariants(self) -> None:
        pass   # no blocks, no state


def ngram_lookup(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Longest suffix of length n in [ngram_min, ngram_max] seen earlier -> the k tokens after it.

    Token ids are spelled as characters so that str.rfind (C speed) does the
    search; the latest earlier occurrence wins.
    """
    if k < 1:
        return []
    text = "".join(map(chr, tokens))
    L = len(tokens)
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        # An occurrence must end before the last token, so at least one token follows it.
        i = text.rfind(text[L - n :], 0, L - 1)
        if i >= 0:
            return tokens[i + n : i + n + k]
    return []


@dataclass(slots=True)
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0   # tokens of the request with KV in the draft cache


class DraftModelProposer:
    """A small model samples k tokens autoregressively over its own paged KV cache."""

    method = "draft"

    def __init__(self, model: nn.Module, k: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, eos_token_id: int | None,
                 choice: Choice = Choice()) -> None:
        self.k = k
        self.eos = eos_token_id
        self.pool = BlockPool(num_blocks, block_size)
        # The draft model runs the engine's path and attention (implementation.choose), without CUDA graphs.
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device, choice)
        self.states: dict[str, _DraftState] = {}

    def propose(self, seqs: list[Sequence], limits: dict[str, int]) -> Drafts:
        drafts = Drafts()
        active = []
        for seq in seqs:
            k = limits[seq.seq_id]
            if k < 1:
                continue
            st = self.states.setdefault(seq.seq_id, _DraftState())
            # Room for the real tokens plus the k - 1 drafts fed back in.
            try:
                self.pool.append_slots(st.block_table, seq.num_tokens + k - 1)
            except MemoryError:           # the draft cache is full: no guess for this one
                self.release(seq.seq_id)
                continue
            active.append((seq, k, st))
            drafts.tokens[seq.seq_id] = []
        q_rows: dict[str, list[torch.Tensor]] = {seq.seq_id: [] for seq, _, _ in active}
        for j in range(max((k for _, k, _ in active), default=0)):
            step = [(seq, st) for seq, k, st in active if k > j]
            inputs = []
            for seq, st in step:
                draft = drafts.tokens[seq.seq_id]
                # Round 0 catches up on every real token the draft has not seen; later rounds feed the last guess.
                new = seq.token_ids(st.num_computed, seq.num_tokens) if j == 0 else draft[-1:]
                inputs.append(RunInput(new, st.num_computed, st.block_table))
                st.num_computed += len(new)
            logits = self.runner.run(self.runner.prepare(inputs))                 # [len(step), V]
            rows = [sampling_rows(seq, drafts.tokens[seq.seq_id], self.eos, j + 1)[j] for seq, _ in step]
            q = probs(logits, rows)                                               # [len(step), V]
            tokens = draw(q, rows).tolist()
            for (seq, _), token, q_row in zip(step, tokens, q):
                drafts.tokens[seq.seq_id].append(token)
                q_rows[seq.seq_id].append(q_row)
        drafts.q = {rid: torch.stack(rows) for rid, rows in q_rows.items() if rows}
        return drafts

    def accepted(self, seq: Sequence, num_tokens_before: int, num_accepted: int) -> None:
        """Keep draft KV only for tokens the request really has now, never its last one; free the rest.

        The next proposal starts by feeding the draft model the request's last token (it needs
        that token's logits), so the draft cache must stop short of it. After a verify the last
        token is the new one and this holds anyway; after drafts that were never run (no budget
        left) nothing was appended, and without the bound the cache would cover every token.
        """
        st = self.states.get(seq.seq_id)
        if st is None:
            return
        st.num_computed = min(st.num_computed, num_tokens_before + num_accepted, seq.num_tokens - 1)
        keep = self.pool.blocks_needed(0, st.num_computed)
        self.pool.free(st.block_table[keep:])
        del st.block_table[keep:]

    def release(self, seq_id: str) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None and st.block_table:
            self.pool.free(st.block_table)

    def check_invariants(self) -> None:
        self.pool.check_invariants([st.block_table for st in self.states.values()])
        for rid, st in self.states.items():
            assert len(st.block_table) == self.pool.blocks_needed(0, st.num_computed), f"draft {rid}: table size"


def truncated_copy(model: nn.Module, num_layers: int) -> nn.Module:
    """The target's first `num_layers` layers with its final norm and head (weights shared, not copied)."""
    if not 1 <= num_layers <= model.num_layers:
        raise ValueError(f"draft_num_layers must be in [1, {model.num_layers}], got {num_layers}")
    draft = copy.copy(model)                     # a new module object over the same parameters
    draft._modules = dict(model._modules)
    if hasattr(model, "blocks"):                 # GPT-2
        draft.blocks = nn.ModuleList(model.blocks[:num_layers])
    else:                                        # Llama
        draft.model = copy.copy(model.model)
        draft.model._modules = dict(model.model._modules)
        draft.model.layers = nn.ModuleList(model.model.layers[:num_layers])
    draft.num_layers = num_layers
    return draft


def build_proposer(config, loaded, dtype: torch.dtype):
    """The proposer the config asks for (None when speculative decoding is off)."""
    if config.speculative_method is None:
        return None
    k = config.num_speculative_tokens
    if config.speculative_method == "ngram":
        return NgramProposer(k, config.ngram_min, config.ngram_max)
    target = loaded.model
    if config.draft_model is None:
        draft = truncated_copy(target, config.draft_num_layers)
    else:
        from nanoserve.models.loader import load_model

        draft = load_model(config.draft_model, dtype, config.device, config.seed).model
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft model {config.draft_model!r} has a vocabulary of {draft.config.vocab_size} "
                             f"tokens, the target {target.config.vocab_size}: they must share a tokenizer")
    return DraftModelProposer(draft, k, config.num_blocks, config.block_size, dtype,
                              torch.device(config.device), loaded.eos_token_id,
                              dataclasses.replace(choose(config), graphs=None))


# -- the engine's side: propose before scheduling, decide after the forward ----------------

def propose(proposer, running: list[Sequence], num_speculative_tokens: int, max_model_len: int,
            pool_tokens: int) -> Drafts:
    """Before scheduling: drafts for every running sequence that is decoding (the engine says so in events).

    `pool_tokens` is what the whole device pool holds: a draft's KV must fit with its sequence's own.
    """
    # Beams are scored together, one token per step. A sequence that still holds the seats of its
    # forks-to-be (n > 1, first token not drawn yet) gets no drafts either: its first token must come
    # from plain sampling, which draws the n first tokens together (token_choice.py) and forks at commit;
    # a verified draft would give the request one first token, shared by every completion.
    seqs = [s for s in running
            if s.num_uncomputed_tokens == 1 and not s.params.use_beam_search and s.seats == 1]
    # Never draft past max_tokens or max_model_len: one step emits up to k + 1 tokens.
    limits = {s.seq_id: max(0, min(num_speculative_tokens, s.params.max_tokens - s.num_output_tokens - 1,
                                       max_model_len - s.num_tokens - 1, pool_tokens - s.num_tokens)) for s in seqs}
    drafts = proposer.propose(seqs, limits)
    drafts.num_tokens = {s.seq_id: s.num_tokens for s in seqs if s.seq_id in drafts.tokens}
    return drafts


@dataclass(slots=True)
class Verdict:
    """What the target model made of one sequence's drafts; the engine applies it when the step commits
    (appends `tokens`, keeps the KV of the `num_accepted` drafts, trims the rest)."""

    tokens: list[SampledToken]   # the accepted drafts plus one corrected or bonus token
    num_accepted: int


def decide(chunk, logits: torch.Tensor, q: torch.Tensor | None, sampler, rule, eos_token_id: int | None,
           masks: torch.Tensor | None = None) -> Verdict:
    """After the forward: exact acceptance of a chunk's drafts against its logits [len(drafts) + 1, V].

    `rule` is the acceptance rule (`verify` above, or a lab's); `q` the draft's distributions
    (None for n-gram drafts); `masks` [len(drafts) + 1, W] the grammar's mask at each position
    (structured output), so that p is the masked distribution and a draft the grammar forbids has
    p(x) = 0: rejected for sure. Changes no bookkeeping (only the sequence's RNG advances).
    """
    seq, draft = chunk.seq, chunk.draft_token_ids
    n = len(draft)
    rows = sampling_rows(seq, draft, eos_token_id, n + 1, masks)
    tokens, accepted = rule(sampler.probs(logits, rows), draft, q[:n] if q is not None else None,
                              seq.params.greedy, seq.generator)
    return Verdict(sampler.report(logits[: len(tokens)], tokens, rows[: len(tokens)]), accepted)
