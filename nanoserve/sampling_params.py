"""SamplingParams: how one request wants its tokens chosen and when it stops.

This module owns the user-facing knobs and their validation. It does not
sample anything itself; `sampler.py` turns these settings into a token, and
`engine.py` checks the stop conditions (`max_tokens`, `stop`, EOS) as tokens
arrive. Field names and meanings follow vLLM so that code written for one
works with the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from nanoserve import validation as v
from nanoserve.errors import FieldError


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                      # completions per prompt: the prompt is computed once, then forked n ways
    temperature: float = 1.0        # 0 means greedy (argmax); higher flattens the distribution
    top_p: float = 1.0              # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0                  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0              # drop tokens whose probability is below min_p * p(most likely)
    max_tokens: int = 16            # generate at most this many tokens
    min_tokens: int = 0             # EOS and stop_token_ids are masked until this many are generated
    stop: list[str] = field(default_factory=list)          # stop strings; never part of the text (one that
                                    # is complete before min_tokens is ordinary text: it stops nothing)
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end the request
    ignore_eos: bool = False        # keep going past the model's EOS token
    presence_penalty: float = 0.0   # subtract this from logits of tokens already generated
    frequency_penalty: float = 0.0  # subtract this x (times generated) from their logits
    repetition_penalty: float = 1.0  # HF/CTRL style: divide positive logits (multiply negative) of seen tokens
    logprobs: int | None = None     # return this many top log-probabilities per token (0: only the chosen one)
    seed: int | None = None         # per-request seed: the same seed gives the same tokens, whatever else runs
    skip_special_tokens: bool = True  # leave special tokens out of the detokenized text
    # Beam search (off when beam_width is 0): keep the beam_width most likely continuations,
    # return the n best, sorted by score = cumulative_logprob / num_output_tokens ** length_penalty.
    beam_width: int = 0             # beams kept each step; needs temperature=0 (beam search does not sample)
    length_penalty: float = 1.0     # as in Hugging Face: > 0 favours longer, < 0 shorter finished beams

    def __post_init__(self) -> None:
        """Check every field's type and range; a bad one raises FieldError naming it."""
        self.n = v.integer("n", self.n, minimum=1)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):
            setattr(self, name, v.number(name, getattr(self, name)))   # finite: NaN would poison the sampler
        for name in ("top_k", "max_tokens", "min_tokens", "beam_width"):
            setattr(self, name, v.integer(name, getattr(self, name)))
        self.logprobs = v.optional_integer("logprobs", self.logprobs, minimum=0)
        self.seed = v.optional_integer("seed", self.seed, minimum=0, maximum=2**64 - 1)
        v.boolean("ignore_eos", self.ignore_eos)
        v.boolean("skip_special_tokens", self.skip_special_tokens)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = v.token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        if self.beam_width:
            self._check_beam()
        if self.temperature < 0:
            raise FieldError("temperature", f"must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise FieldError("top_k", f"must be -1, 0 (both: off) or a positive count, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise FieldError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise FieldError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise FieldError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise FieldError("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise FieldError("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise FieldError("repetition_penalty", f"must be > 0 (1 is off), got {self.repetition_penalty}")

    def _check_beam(self) -> None:
        """Beam search picks the most likely continuations: sampling settings contradict it."""
        if self.beam_width < 1:
            raise FieldError("beam_width", f"must be 0 (off) or at least 1, got {self.beam_width}")
        if self.n > self.beam_width:
            raise FieldError("n", f"is {self.n}, but beam search returns at most beam_width={self.beam_width} "
                                  "completions")
        defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        clashes = [name for name, off in defaults.items()
                   if getattr(self, name) != off and not (name == "top_k" and self.top_k == -1)]
        if clashes:
            raise FieldError(clashes[0], "contradicts beam search, which keeps the most likely continuations "
                             f"and does not sample: {', '.join(f'{n}={getattr(self, n)}' for n in clashes)} "
                             "(use temperature=0, the rest at their defaults)")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 0

    @property
    def num_seqs(self) -> int:
        """Sequences this request runs at once: n for parallel sampling, beam_width for beam search."""
        return self.beam_width or self.n

    @property
    def greedy(self) -> bool:
        """True when the choice is a plain argmax (temperature 0)."""
        return self.temperature == 0.0


def _stop_strings(stop) -> list[str]:
    """`stop` as a list of non-empty strings (one string alone is a list of one)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, (list, tuple)):
        raise FieldError("stop", f"must be a str or a list of str, got {stop!r} ({type(stop).__name__})")
    for s in stop:
        if not isinstance(s, str):
            raise FieldError("stop", f"must hold only strings, got {s!r} ({type(s).__name__}); "
                                     "token ids go in stop_token_ids")
        if not s:
            raise FieldError("stop", "strings must be non-empty")
        v.well_formed("stop", s)
    return list(stop)


def to_pairs(params: SamplingParams, seed: int | None = None) -> tuple[tuple[str, object], ...]:
    """The fields set away from their defaults as (name, value) pairs, lists as tuples, and the
    seed (`seed` when given: the one the request actually got). Plain data, for `RequestAdded`."""
    default = SamplingParams()
    pairs = []
    for f in fields(SamplingParams):
        value = seed if f.name == "seed" and seed is not None else getattr(params, f.name)
        if value != getattr(default, f.name) or (f.name == "seed" and value is not None):
            pairs.append((f.name, tuple(value) if isinstance(value, list) else value))
    return tuple(pairs)


def from_pairs(pairs) -> SamplingParams:
    """Inverse of `to_pairs` (tuples back to lists): the SamplingParams a request was added with."""
    return SamplingParams(**{name: list(value) if isinstance(value, tuple) else value for name, value in pairs})
