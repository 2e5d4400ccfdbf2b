"""SamplingParams: how one request wants its tokens chosen and when it stops.

This module owns the user-facing knobs and their validation. It does not
sample anything itself; `sampler.py` turns these settings into a token, and
`engine.py` checks the stop conditions (`max_tokens`, `stop`, EOS) as tokens
arrive. Field names and meanings follow vLLM so that code written for one
works with the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                      # completions per prompt: the prompt is computed once, then forked n ways
    temperature: float = 1.0        # 0 means greedy (argmax); higher flattens the distribution
    top_p: float = 1.0              # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0                  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0              # drop tokens whose probability is below min_p * p(most likely)
    max_tokens: int = 16            # generate at most this many tokens
    min_tokens: int = 0             # EOS and stop_token_ids are masked until this many are generated
    stop: list[str] = field(default_factory=list)          # stop strings; never part of the text
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.beam_width:
            self._check_beam()
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both: off) or a positive count, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def _check_beam(self) -> None:
        """Beam search picks the most likely continuations: sampling settings contradict it."""
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be 0 (off) or at least 1, got {self.beam_width}")
        if self.n > self.beam_width:
            raise ValueError(f"beam search returns at most beam_width={self.beam_width} completions, asked n={self.n}")
        defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        clashes = [f"{name}={getattr(self, name)}" for name, off in defaults.items()
                   if getattr(self, name) != off and not (name == "top_k" and self.top_k == -1)]
        if clashes:
            raise ValueError(f"beam search keeps the most likely continuations and does not sample; "
                             f"these settings contradict it: {', '.join(clashes)} (use temperature=0, the rest "
                             "at their defaults)")

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
