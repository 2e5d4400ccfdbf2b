"""Structured output: each sequence's grammar, the token mask it makes every step, and its matcher.

A request with `structured_outputs` (a JSON schema, a regex, a list of choices or
an EBNF grammar: `sampling_params.py`) must produce text the grammar accepts.
At every position the grammar allows some tokens of the vocabulary and forbids
the rest; the sampler draws only from the allowed ones, so the distribution is
the model's own, restricted to them and renormalised. Where it lives in a step:

    add_request  intake.py compiles the grammar for the model's vocabulary (`GrammarCompiler`,
                 one per tokenizer) and gives the first sequence a `SequenceGrammar`:
                 a bad schema, regex or grammar is a FieldError, and nothing is queued
    compute      token_choice.py *reads* each constrained sequence's matcher: `next_mask()` is a
                 bitmask row [ceil(V / 32)] int32 (bit t of the row set: token t allowed);
                 a speculative step gets one row per draft position from a throwaway fork
                 (`draft_masks`). The sampler applies the rows to the logits after penalties and
                 min_tokens, before temperature, top-k, top-p and min-p (`apply_masks`: one
                 call for the whole batch)
    commit       request_table.py advances the matcher with each token the sequence keeps
                 (`accept`); a grammar that can only end now finishes the sequence ("stop"),
                 and EOS is allowed exactly where the grammar can end
    fork         `Sequence.fork` forks the matcher with its sequence (n > 1, beams, engine.fork)

The compute phase never advances a matcher, so a failed step leaves every
matcher as it was, and draft tokens the target rejects were only ever accepted
by a fork that is thrown away. Preemption (recompute or swap) keeps the
matcher: it follows the output tokens, which both keep. A what-if replay
builds new matchers from the request's parameters.

The grammar engine is xgrammar (the library vLLM and SGLang use by default):
it compiles a grammar against the tokenizer's vocabulary once, and then a
matcher fills a mask in microseconds, mostly from masks it precomputed. This
module is the only one that imports it, and only when a request asks for
structured output.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from nanoserve.errors import FieldError

EXTRA = "structured output needs xgrammar: pip install xgrammar"
CACHE_BYTES = 512 << 20   # compiled grammars each GrammarCompiler keeps (least recently used go first)
_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> {(V, eos): GrammarCompiler}


def xgrammar():
    """The xgrammar module, or an ImportError that says how to get it."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise ImportError(EXTRA) from exc
    return xgr


# JSON is constrained to one line with ", " and ": " between items: a model allowed any
# whitespace can spend its whole budget on newlines (small models do).
JSON_LAYOUT = dict(any_whitespace=False)


def parse_grammar(spec):
    """Parse `spec` (a StructuredOutputsParams) without a tokenizer; raises xgrammar's error if it is bad."""
    xgr = xgrammar()
    kind = spec.kind
    if kind == "json":
        return _json_strings(xgr.Grammar.from_json_schema(spec.json, strict_mode=not spec.additional_properties,
                                                          **JSON_LAYOUT))
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_regex("|".join(_regex_literal(c) for c in spec.choice))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.grammar)
    # json_object: any JSON object (OpenAI's meaning; xgrammar's builtin JSON grammar allows any value)
    return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **JSON_LAYOUT)


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as [^"\\\r\n], which lets
# control characters (U+0000-U+001F) through: JSON forbids them unescaped, and json.loads refuses
# them. Its unbounded strings exclude them; bounded ones get the same class here.
_LOOSE_CHARS, _JSON_CHARS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def _json_strings(grammar):
    """`grammar` with JSON's string characters in bounded strings too (see _LOOSE_CHARS)."""
    text = str(grammar)
    if _LOOSE_CHARS not in text:
        return grammar
    return xgrammar().Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))


def error_reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location ("[10:16:02] /project/cpp/x.cc:83: ...")."""
    text = " ".join(str(exc).split())
    if "] " in text[:20] and ": " in text:
        text = text.split("] ", 1)[1]
        text = text.split(": ", 1)[1] if text.startswith("/") else text
    return text.removeprefix("Check failed: (error.empty()) is false: ")[:300]


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it (every character that means something escaped)."""
    return "(" + "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text) + ")"


class GrammarCompiler:
    """Compiles grammars for one vocabulary: xgrammar's TokenizerInfo (built once: about half a
    second for SmolLM2's 49,152 tokens) and its compiler, which caches what it compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        xgr = xgrammar()
        stop = [eos_token_id] if eos_token_id is not None else None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(self.info.stop_token_ids)

    def compile(self, spec):
        """A CompiledGrammar for `spec`; FieldError naming its field when xgrammar refuses it."""
        try:
            return self.compiler.compile_grammar(parse_grammar(spec))
        except (RuntimeError, ValueError) as exc:
            raise FieldError(f"structured_outputs.{spec.kind}", f"cannot be compiled for this model's "
                                                                f"vocabulary: {error_reason(exc)}") from None

    def matcher(self, spec) -> SequenceGrammar:
        """A fresh SequenceGrammar for `spec`, at the start of the output."""
        return SequenceGrammar(xgrammar().GrammarMatcher(self.compile(spec)), spec.kind, self.vocab_size,
                               self.stop_token_ids)


def compiler_for(tokenizer, vocab_size: int, eos_token_id: int | None) -> GrammarCompiler:
    """The GrammarCompiler of this tokenizer and vocabulary, built on first use and shared by
    every engine on the same loaded model (what-if replays build many)."""
    if tokenizer is None:
        raise FieldError("structured_outputs", "needs the model's tokenizer; this model has none")
    per_tokenizer = _COMPILERS.setdefault(tokenizer, {})
    key = (vocab_size, eos_token_id)
    if key not in per_tokenizer:
        per_tokenizer[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_id)
    return per_tokenizer[key]


def mask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row: one bit per token."""
    return (vocab_size + 31) // 32


class SequenceGrammar:
    """One sequence's place in its grammar: an xgrammar GrammarMatcher over the tokens it kept."""

    __slots__ = ("matcher", "kind", "vocab_size", "stop_token_ids")

    def __init__(self, matcher, kind: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.kind = kind                      # "json", "regex", "choice", "grammar" or "json_object"
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids  # EOS: allowed where the grammar can end

    def fork(self) -> SequenceGrammar:
        """An independent copy at the same place (a forked sequence continues on its own)."""
        return SequenceGrammar(self.matcher.fork(), self.kind, self.vocab_size, self.stop_token_ids)

    # -- reading (the compute phase) --

    def next_mask(self) -> torch.Tensor:
        """The tokens allowed next, as a bitmask row [ceil(V / 32)] int32. Reads the matcher only."""
        row = torch.empty(1, mask_words(self.vocab_size), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        return row[0]

    def draft_masks(self, draft: list[int]) -> torch.Tensor:
        """Speculative decoding: the mask at each position of `draft` and after it, [len(draft) + 1, W],
        each as if the drafts before it were kept. A fork accepts the drafts; this matcher stays put.

        After a draft the grammar refuses (the target rejects it for sure: its masked probability is 0)
        or an EOS, the later positions are never used; they repeat the last real row."""
        masks = torch.empty(len(draft) + 1, mask_words(self.vocab_size), dtype=torch.int32)
        ahead = self.matcher.fork()
        for i in range(len(draft) + 1):
            ahead.fill_next_token_bitmask(masks, i)
            if i == len(draft) or ahead.is_terminated() or not ahead.accept_token(draft[i]) \
                    or ahead.is_terminated():
                masks[i + 1:] = masks[i]
                break
        return masks

    # -- advancing (the commit phase) --

    def accept(self, token_id: int) -> bool:
        """Advance over a kept token; True when the grammar is over (EOS, or nothing can follow).
        A token the grammar refuses is a bug in the masking: ValueError (the request fails)."""
        if not self.matcher.accept_token(token_id):
            raise ValueError(f"structured output: the grammar does not allow token {token_id} here")
        return self.matcher.is_terminated() or self.can_only_end()

    def can_only_end(self) -> bool:
        """The grammar is complete and allows nothing but EOS next: the output is done."""
        if not self.matcher.is_completed():
            return False
        allowed = allowed_tokens(self.next_mask(), self.vocab_size)
        return set(allowed) <= set(self.stop_token_ids)


def check_satisfiable(grammar: SequenceGrammar, spec, params, eos_token_id: int | None,
                      field: str | None = None) -> None:
    """FieldError when a fresh request's constraint can never be met, found before it runs: the first
    position allows no token the sampler may draw (a regex that matches nothing, `root ::= root`; EOS
    and stop_token_ids do not count before min_tokens), or min_tokens is longer than every choice
    (a token is at least one byte). `field` names the client's field (default structured_outputs.KIND)."""
    field = field or f"structured_outputs.{spec.kind}"
    banned = set(params.stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set()) \
        if params.min_tokens else set()
    if allows_nothing(grammar.next_mask(), grammar.vocab_size, banned):
        raise FieldError(field, "allows no token at the first position: no output can satisfy it"
                         + (f" (EOS is forbidden there by min_tokens={params.min_tokens})" if banned else ""))
    if spec.kind == "choice" and params.min_tokens:
        longest = max(len(c.encode()) for c in spec.choice)
        if params.min_tokens > longest:
            raise FieldError("min_tokens", f"is {params.min_tokens}, but the longest choice of {field} is "
                                           f"{longest} bytes, so at most {longest} tokens: no output can satisfy both")


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row [W] allows."""
    bits = (row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1      # [W, 32]
    return bits.reshape(-1)[:vocab_size].nonzero()[:, 0].tolist()


# -- the sampler's side: apply a batch of masks, and say what they did --------------------------


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of `logits` [B, V] with -inf wherever row rows[i]'s mask masks[i] [W] forbids a token."""
    out = logits.clone()
    full = torch.full((logits.shape[0], masks.shape[1]), -1, dtype=torch.int32)   # -1: every bit set
    full[rows] = masks.to(torch.int32)
    xgrammar().apply_token_bitmask_inplace(out, full.to(logits.device), vocab_size=logits.shape[1], indices=rows)
    return out


@dataclass(frozen=True, slots=True)
class MaskInfo:
    """What the grammar's mask did at one position (for the TokenConstrained event)."""

    num_allowed: int        # tokens the mask allowed
    top_masked: bool        # the model's own most likely token was forbidden
    forced: bool            # exactly one token was allowed: the grammar chose it, not the model


@functools.cache
def _popcount_table() -> torch.Tensor:
    return torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int32)


def _in_vocab(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A copy of masks [B, W] with the bits past the vocabulary (the last word's spare ones) cleared."""
    masks = masks.to(torch.int32).clone()
    spare = masks.shape[1] * 32 - vocab_size
    if spare:
        masks[:, -1] &= (1 << (32 - spare)) - 1
    return masks


def count_allowed(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How many tokens each row of masks [B, W] allows: [B], by a 256-entry table over its bytes."""
    return _popcount_table()[_in_vocab(masks, vocab_size).view(torch.uint8).long()].sum(-1)


def allows_nothing(mask: torch.Tensor, vocab_size: int, banned: set[int]) -> bool:
    """Does the mask row [W] allow no token outside `banned` (EOS before min_tokens)?"""
    n = int(count_allowed(mask[None], vocab_size)[0])
    if n > len(banned):
        return False
    return set(allowed_tokens(mask, vocab_size)) <= banned


def mask_info(raw_logits: torch.Tensor, masks: torch.Tensor) -> list[MaskInfo]:
    """Per row: how many tokens masks [B, W] allows (bits past V not counted) and whether it
    forbids the argmax of raw_logits [B, V]. Vectorised: one table lookup for the counts."""
    V = raw_logits.shape[-1]
    masks = _in_vocab(masks, V)
    counts = _popcount_table()[masks.view(torch.uint8).long()].sum(-1)   # [B]
    top = raw_logits.argmax(-1).cpu()                             # [B]
    top_bit = (masks[torch.arange(len(top)), top // 32].to(torch.int64) >> (top % 32)) & 1
    return [MaskInfo(int(n), not bool(b), int(n) == 1) for n, b in zip(counts.tolist(), top_bit.tolist())]
