"""SamplingParams: how one request wants its tokens chosen and when it stops.

This module owns the user-facing knobs and their validation. It does not
sample anything itself; `sampler.py` turns these settings into a token, and
`engine.py` checks the stop conditions (`max_tokens`, `stop`, EOS) as tokens
arrive. Field names and meanings follow vLLM so that code written for one
works with the other.

`StructuredOutputsParams` (vLLM's name and fields) asks for structured output:
a JSON schema, a regular expression, a list of choices or a grammar the text
must match. Its syntax is checked here (by xgrammar's parsers, which need no
tokenizer); `structured_output.py` compiles it for the model's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from nanoserve import validation as v
from nanoserve.errors import FieldError

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What the output must match: set exactly one of the first five fields.

        SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

    A bad schema, regex or grammar raises FieldError("structured_outputs.<field>", ...).
    """

    json: str | dict | None = None    # a JSON schema (a dict, or its JSON text): the output is JSON valid under it
    regex: str | None = None          # the whole output matches this regular expression
    choice: list[str] | None = None   # the output is exactly one of these strings
    grammar: str | None = None        # an EBNF grammar (GBNF as llama.cpp writes it); its rule `root` is the output
    json_object: bool = False         # any JSON object (OpenAI's response_format {"type": "json_object"})
    additional_properties: bool = False   # json: allow object properties the schema does not name
                                          # (OpenAI's strict=false); by default only what it names

    def __post_init__(self) -> None:
        """One kind set, each value of its type, its syntax parsed; `json` kept as canonical JSON text."""
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise FieldError("structured_outputs", "must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(set_) or 'none'}")
        v.boolean("structured_outputs.json_object", self.json_object)
        v.boolean("structured_outputs.additional_properties", self.additional_properties)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                v.text(f"structured_outputs.{name}", getattr(self, name))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        _parse(self)

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def to_pairs(self) -> tuple[tuple[str, object], ...]:
        """The fields set, as (name, value) pairs (lists as tuples): plain data for events and logs."""
        pairs = [(self.kind, tuple(self.choice) if self.kind == "choice" else getattr(self, self.kind))]
        if self.additional_properties:
            pairs.append(("additional_properties", True))
        return tuple(pairs)

    @classmethod
    def from_pairs(cls, pairs) -> StructuredOutputsParams:
        return cls(**{k: list(value) if isinstance(value, tuple) else value for k, value in pairs})


def _schema_text(schema) -> str:
    """A JSON schema given as a dict or as JSON text -> its JSON text (FieldError if it is neither)."""
    name = "structured_outputs.json"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise FieldError(name, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise FieldError(name, f"must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)


def _choices(choice) -> list[str]:
    name = "structured_outputs.choice"
    if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)):
        raise FieldError(name, f"must be a list of strings, got {choice!r:.60}")
    if not choice:
        raise FieldError(name, "must hold at least one string")
    for c in choice:
        if not isinstance(c, str) or not c:
            raise FieldError(name, f"must hold only non-empty strings, got {c!r:.60}")
    return list(choice)


def _parse(spec: StructuredOutputsParams) -> None:
    """Parse the grammar with xgrammar (no tokenizer needed): FieldError naming the field, with
    xgrammar's own reason, for a schema, regex or grammar it cannot read."""
    from nanoserve.structured_output import error_reason, parse_grammar  # (xgrammar only when asked for)

    try:
        parse_grammar(spec)
    except (RuntimeError, ValueError) as exc:
        kind = spec.kind
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(kind, kind)
        raise FieldError(f"structured_outputs.{kind}", f"is not a valid {what}: {error_reason(exc)}") from None


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                      # completions per prompt: the prompt is computed once, then forked n ways
    temperature: float = 1.0        # 0 means greedy (argmax); higher flattens the distribution
    top_p: float = 1.0              # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0                  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0              # drop tokens whose probability is below min_p * p(most likely)
    max_tokens: int = 16            # generate at most this many tokens
    min_tokens: int = 0             # EOS and stop_token_ids are masked until this many are generated
    stop: list[str] = field(default_factory=list)          # stop strings; not part of the text (one that
                                    # is complete before min_tokens is ordinary text: it stops nothing)
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end the request
    ignore_eos: bool = False        # keep going past the model's EOS token
    presence_penalty: float = 0.0   # subtract this from logits of tokens already generated
    frequency_penalty: float = 0.0  # subtract this x (times generated) from their logits
    repetition_penalty: float = 1.0  # HF/CTRL style: divide positive logits (multiply negative) of seen tokens
    logprobs: int | None = None     # return this many top log-probabilities per token (0: only the chosen one)
    prompt_logprobs: int | None = None  # the same for every prompt token, from the prefill's logits
                                    # (prompt_logprobs.py; such a request skips the prefix-cache lookup)
    seed: int | None = None         # per-request seed: the same seed gives the same tokens, whatever else runs
    skip_special_tokens: bool = True  # leave special tokens out of the detokenized text
    include_stop_str_in_output: bool = False   # keep the stop string that ended the text in the text
    # Beam search (off when beam_width is 0): keep the beam_width most likely continuations,
    # return the n best, sorted by score = cumulative_logprob / num_output_tokens ** length_penalty.
    beam_width: int = 0             # beams kept each step; needs temperature=0 (beam search does not sample)
    length_penalty: float = 1.0     # as in Hugging Face: > 0 favours longer, < 0 shorter finished beams
    # Structured output: the text must match a JSON schema, regex, choice or grammar (None: free text).
    # A dict is read as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        """Check every field's type and range; a bad one raises FieldError naming it."""
        self.n = v.integer("n", self.n, minimum=1)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):
            setattr(self, name, v.number(name, getattr(self, name)))   # finite: NaN would poison the sampler
        for name in ("top_k", "max_tokens", "min_tokens", "beam_width"):
            setattr(self, name, v.integer(name, getattr(self, name)))
        self.logprobs = v.optional_integer("logprobs", self.logprobs, minimum=0)
        self.prompt_logprobs = v.optional_integer("prompt_logprobs", self.prompt_logprobs, minimum=0)
        self.seed = v.optional_integer("seed", self.seed, minimum=0, maximum=2**64 - 1)
        v.boolean("ignore_eos", self.ignore_eos)
        v.boolean("skip_special_tokens", self.skip_special_tokens)
        v.boolean("include_stop_str_in_output", self.include_stop_str_in_output)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = v.token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        if self.beam_width:
            self._check_beam()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise FieldError("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields), "
                                                   f"got {type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None and self.ignore_eos:
            raise FieldError("ignore_eos", "contradicts structured_outputs: the grammar decides where the output "
                                           "ends (EOS is allowed exactly where it can end)")
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
        if isinstance(value, StructuredOutputsParams):
            value = value.to_pairs()
        if value != getattr(default, f.name) or (f.name == "seed" and value is not None):
            pairs.append((f.name, tuple(value) if isinstance(value, list) else value))
    return tuple(pairs)


def from_pairs(pairs) -> SamplingParams:
    """Inverse of `to_pairs` (tuples back to lists): the SamplingParams a request was added with."""
    fields_ = {name: list(value) if isinstance(value, tuple) else value for name, value in pairs}
    if fields_.get("structured_outputs") is not None:
        fields_["structured_outputs"] = StructuredOutputsParams.from_pairs(fields_["structured_outputs"])
    return SamplingParams(**fields_)
