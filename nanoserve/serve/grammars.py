"""Structured output's grammars, compiled off the engine thread: bounded in size, time and thread.

Compiling a grammar for the model's vocabulary (xgrammar's GrammarCompiler)
can take from microseconds to minutes: it grows with the grammar's rules,
alternatives and repetition bounds, and with the vocabulary. The engine
compiles in `add_request` (intake), on the engine thread: one large grammar
there would hold every other request. So the server compiles it first, here:

    route (asyncio)                         compile thread (GRAMMAR_THREADS)        engine thread
    size of the field's text -> 400         (structured.py, before parsing)
    await GrammarCompiles.check(...) -----> parse, count rules and repeats -> 400
      (gives up after deadline_s: 400)      compile for the vocabulary (xgrammar's
                                            cache keeps it), the first mask -> 400
    EngineLoop.submit ------------------------------------------------------------> add_request: the compile
                                                                                    is a cache hit

A request waits for its own compile (and at most GRAMMAR_THREADS others'
ahead of it), never holds anyone else's. A thread cannot be stopped: a compile
that outlives its deadline goes on to the end, taking a core. Why not a
process that could be killed: xgrammar's CompiledGrammar can be serialised
(`serialize_json`), but the text holds its precomputed masks and grows far
faster than the compile time: 2,000 chained rules compile in 0.09 s and
serialise to 218 MB in 32 s. So the limits below are what bound the work
(docs/serve.md says what they were measured on). The costly constructs were
measured on SmolLM2's 49,152-token vocabulary: a bounded repetition of a
character class (`[^"]{0,128} "x"`: 4.3 s; `[^"]*`: instant), many rules with
open classes, many alternatives; JSON schemas' own repetitions compile fast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re

from nanoserve import structured_output
from nanoserve.errors import FieldError
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.serve.protocol import ApiError

MAX_RULES = 512          # rules of the parsed grammar (a JSON schema's or a regex's too)
MAX_REPEAT = 128         # a grammar's or regex's repetitions {m,n}: their bounds added up
MAX_JSON_REPEAT = 4096   # a JSON schema's: its largest maxLength, maxItems, ... (xgrammar's own rules for
                         # them compile quickly: 0.4 s for maxLength 2048 on SmolLM2's vocabulary)
DEADLINE_S = 10.0        # a grammar not compiled by then: the request is refused (400)
GRAMMAR_THREADS = 2      # compiles at once

_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(-?\d+)\s*)?\}")


def check_size(spec: StructuredOutputsParams, field: str) -> None:
    """FieldError naming `field` when the parsed grammar has more than MAX_RULES rules or a repetition
    bound past MAX_REPEAT (cheap: parsing is linear; compiling is what takes long)."""
    text = str(structured_output.parse_grammar(spec))
    rules = text.count("::=")
    if rules > MAX_RULES:
        raise FieldError(field, f"makes a grammar of {rules} rules; the server compiles at most {MAX_RULES}")
    bounds = [max(_number(m.group(1)), _number(m.group(2) or "0")) for m in _REPEAT.finditer(text)]
    if spec.kind in ("json", "json_object"):
        if bounds and max(bounds) > MAX_JSON_REPEAT:
            raise FieldError(field, f"repeats something up to {max(bounds)} times (a maxLength, maxItems or "
                                    f"similar bound); the server compiles bounds of at most {MAX_JSON_REPEAT}")
    elif sum(bounds) > MAX_REPEAT:
        raise FieldError(field, f"has repetitions {{m,n}} whose bounds add up to {sum(bounds)}; the server "
                                f"compiles at most {MAX_REPEAT} (a bounded repetition of a character class "
                                "takes seconds per hundred to compile: use * or + where you can)")


def _number(digits: str) -> int:
    """A bound as printed (capped: a bound of thousands of digits is past every limit, and int() refuses it)."""
    return int(digits) if len(digits) <= 12 else 10**12


class GrammarCompiles:
    """Compiles requests' grammars on threads of their own, for one engine's vocabulary."""

    def __init__(self, engine, deadline_s: float = DEADLINE_S, threads: int = GRAMMAR_THREADS) -> None:
        self.engine = engine                # read only: its tokenizer, vocab_size and eos_token_id
        self.deadline_s = deadline_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "nanoserve-grammar")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def check(self, spec: StructuredOutputsParams, field: str, params: dict) -> None:
        """Compile `spec` off the engine thread and check it can be satisfied; ApiError 400 naming `field`
        (or min_tokens) when it is too large, cannot be met, or does not compile within the deadline."""
        try:
            future = self._pool.submit(self._compile, spec, field, params)
        except RuntimeError:                # shut down: the server is stopping
            raise ApiError(503, "the server is shutting down") from None
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.deadline_s)
        except FieldError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        except asyncio.TimeoutError:
            raise ApiError(400, f"{field} did not compile for this model's vocabulary within {self.deadline_s:g} s: "
                                "send a smaller grammar", field) from None

    def _compile(self, spec: StructuredOutputsParams, field: str, params: dict) -> None:
        """A compile thread: limits, compile (into xgrammar's cache, where add_request finds it), first mask."""
        check_size(spec, field)
        engine = self.engine
        compiler = structured_output.compiler_for(engine.tokenizer, engine.vocab_size, engine.eos_token_id)
        try:
            grammar = compiler.matcher(spec)
        except FieldError as exc:
            raise FieldError(field, exc.text) from None
        sampling = SamplingParams(min_tokens=params.get("min_tokens") or 0,
                                  stop_token_ids=list(params.get("stop_token_ids") or []))
        structured_output.check_satisfiable(grammar, spec, sampling, engine.eos_token_id, field)
