"""Intake: turn `add_request`'s arguments into a checked, ready-to-queue request, changing nothing.

`prepare()` does every check that can fail — types of the id, prompt,
params and priority, tokenization, the vocabulary, `max_model_len`, seats
and blocks for parallel sampling and beam search, compiling a structured
output's grammar — and builds the request's first `Sequence` (with its
grammar's matcher), its `Request` and its detokenizer. Only then does the
engine register them (plain dict and queue insertions that cannot fail), so
a bad request leaves the engine exactly as it was: all or nothing.

    prepared = intake.prepare(engine, "r1", "Hello", SamplingParams(max_tokens=8))   # may raise
    engine.enqueue(prepared)                                                           # cannot fail

Every refusal is a `FieldError` naming the argument ("prompt",
"request_id", "priority", "params") or the `SamplingParams` field
("stop_token_ids", "n", "beam_width", ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nanoserve import structured_output
from nanoserve import validation as v
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.errors import FieldError
from nanoserve.request import Request
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence


@dataclass(slots=True)
class PreparedRequest:
    """Everything a request needs, built but not yet known to the engine."""

    seq: Sequence
    request: Request
    detokenizer: IncrementalDetokenizer


def prepare(engine, request_id, prompt, params, arrival_time=None, priority=0) -> PreparedRequest:
    """Check one request against the engine's model and limits; build it. Raises FieldError.

    `engine` is an LLMEngine, only read (its requests and sequences, tokenizer, vocabulary, config and pool);
    not named as a type, since engine.py imports this module."""
    v.text("request_id", request_id)
    if request_id in engine.sequences or request_id in engine.requests:
        raise FieldError("request_id", f"{request_id!r} is already in use")
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise FieldError("params", f"must be a SamplingParams, got {type(params).__name__}")
    else:   # a private, re-checked copy: later changes to the caller's object change nothing here
        params = dataclasses.replace(params)
    priority = v.integer("priority", priority)
    if arrival_time is not None:
        arrival_time = v.number("arrival_time", arrival_time)
    text, token_ids = tokenize(engine, prompt)
    ends = [i for i in getattr(getattr(engine, "loaded", None), "end_token_ids", ()) if i not in params.stop_token_ids]
    if ends and not params.ignore_eos:   # a chat model's other end-of-turn ids stop it as EOS does (as HF's generate)
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *ends])
    _check_limits(engine, params, token_ids)
    # An unseeded request gets its seed from the engine's RNG when it is queued (not here:
    # preparing changes nothing, not even that RNG).
    seed = params.seed
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    grammar = None
    if params.structured_outputs is not None:   # compiled for this vocabulary: FieldError before anything changes
        grammar = structured_output.compiler_for(engine.tokenizer, engine.vocab_size,
                                                 engine.eos_token_id).matcher(params.structured_outputs)
    seq = Sequence(request_id, text, token_ids, params, generator=generator, priority=priority,
                   seats=params.num_seqs, grammar=grammar)
    if arrival_time is not None:
        seq.arrival_time = arrival_time
    if params.logprobs is not None:
        seq.logprobs = []
    if params.prompt_logprobs is not None:
        seq.prompt_logprobs = [None]   # the first prompt token has no context, so no log-probability
    return PreparedRequest(seq, Request(request_id, params, seed, [seq]),
                           IncrementalDetokenizer(engine.tokenizer, params))


def tokenize(engine, prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text or as token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise FieldError("prompt", "is empty")
        v.well_formed("prompt", prompt)
        if engine.tokenizer is None:
            raise FieldError("prompt", f"is text, but model {engine.config.model!r} has no tokenizer: "
                                       "pass the prompt as token ids")
        token_ids = list(engine.tokenizer(prompt).input_ids)
        if not token_ids:
            raise FieldError("prompt", "is empty after tokenization")
        return prompt, token_ids
    if isinstance(prompt, (bytes, bytearray)):
        raise FieldError("prompt", "is bytes: pass text as a str (decode it first) or token ids as a list of ints")
    token_ids = v.token_ids("prompt", prompt, engine.vocab_size)
    if not token_ids:
        raise FieldError("prompt", "is empty")
    return None, token_ids


def _check_limits(engine, params: SamplingParams, token_ids: list[int]) -> None:
    """What depends on the model and the engine's settings: vocabulary, length, seats, blocks."""
    config, vocab = engine.config, engine.vocab_size
    v.token_ids("stop_token_ids", params.stop_token_ids, vocab)
    if params.stop and engine.tokenizer is None:
        raise FieldError("stop", "strings need a tokenizer; this model has none (use stop_token_ids)")
    if params.min_tokens:
        masked = set(params.stop_token_ids) | ({engine.eos_token_id} if engine.eos_token_id is not None else set())
        if len(masked) >= vocab:
            raise FieldError("stop_token_ids", f"with min_tokens={params.min_tokens} mask every token of the "
                                               "vocabulary: nothing could be generated")
    max_len = config.max_model_len
    if len(token_ids) >= max_len:
        raise FieldError("prompt", f"has {len(token_ids)} tokens; max_model_len is {max_len}, "
                                   "which leaves no room to generate")
    if params.num_seqs > config.max_num_seqs:
        field = "beam_width" if params.use_beam_search else "n"
        raise FieldError(field, f"is {params.num_seqs}: that many sequences cannot run together with "
                                f"max_num_seqs={config.max_num_seqs}")
    if params.use_beam_search:
        length = min(max_len, len(token_ids) + params.max_tokens)
        worst = params.num_seqs * engine.kv.blocks_for(length, 1)   # (KV cache groups: every group's blocks)
        if worst > engine.pool.num_blocks:
            raise FieldError("beam_width", f"is {params.num_seqs}: beam search with {params.num_seqs} beams may "
                                           f"need {worst} blocks; the pool has {engine.pool.num_blocks}")
