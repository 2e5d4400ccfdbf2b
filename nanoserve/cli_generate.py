"""`nanoserve generate`'s parts: its structured-output flags, and the loop that runs the prompts.

`cli.py` parses the command line and builds the engine; `run_generate` adds the
prompts, steps the engine to the end and prints what it generated (streamed when
there is one completion), then with `--stats` what ran and how fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanoserve.errors import FieldError
from nanoserve.viz.text import byte_text, escaped, plural


def say(line: str | None) -> None:
    """A note on stderr (the thread policy's line, for one): nothing when there is none."""
    if line:
        print(line, file=sys.stderr, flush=True)


def add_structured_flags(gen) -> None:
    """`generate`'s structured output: each flag stores under the StructuredOutputsParams field it sets
    (dest "structured_outputs.regex"), so a FieldError about that field names the flag."""
    so = gen.add_argument_group("structured output", "the text must match (one of these; SamplingParams "
                                                     "structured_outputs)")
    so.add_argument("--json-schema", dest="structured_outputs.json", default=None, metavar="FILE",
                    help="a JSON schema file: the output is JSON valid under it")
    so.add_argument("--regex", dest="structured_outputs.regex", default=None, metavar="RE",
                    help="the whole output matches this regular expression")
    so.add_argument("--choice", dest="structured_outputs.choice", default=None, metavar="A,B,C",
                    help="the output is exactly one of these comma-separated strings")
    so.add_argument("--grammar", dest="structured_outputs.grammar", default=None, metavar="FILE",
                    help="an EBNF (GBNF) grammar file whose rule `root` is the output")


def structured_flags(args: argparse.Namespace):
    """The StructuredOutputsParams the flags ask for (None: free text). Files are read here."""
    from nanoserve.sampling_params import StructuredOutputsParams

    given = {name: getattr(args, f"structured_outputs.{name}") for name in ("json", "regex", "choice", "grammar")}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --regex, --choice, --grammar, not several")
    for name in ("json", "grammar"):                 # these two flags name files
        if name in given:
            path = Path(given[name])
            if not path.is_file():
                raise FieldError(f"structured_outputs.{name}", f"{path}: no such file")
            given[name] = path.read_text(encoding="utf-8")
    if "choice" in given:
        given["choice"] = [c for c in given["choice"].split(",")]
    return StructuredOutputsParams(**given)


def run_generate(engine, args: argparse.Namespace, params, threads) -> None:
    """Add the prompts, step to the end, print what `generate` prints."""
    import time

    say(threads.note())                               # after the model loaded: errors stay one line
    prompts = args.prompts
    if args.chat:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError(f"model {args.model!r} has no chat template; drop --chat")
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    stream = len(prompts) == 1 and params.n == 1 and not params.use_beam_search
    # what is printed: never a raw control character; a byte-level random model's bytes escaped (`\x8f`)
    byte_level = is_byte_level(engine)

    def shown(c, final: bool = True) -> str:
        return byte_text(c.token_ids, final) if byte_level else escaped(c.text)

    t0, steps, generated, printed = time.perf_counter(), 0, 0, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        for out in result.outputs:
            if stream:
                text = shown(out.outputs[0], out.finished)   # all of it so far: print what is new
                print(text[printed:], end="", flush=True)
                printed = len(text)
                if out.finished:
                    print()
            elif out.finished:
                for completion in out.outputs:
                    label = f"{out.request_id}" + (f".{completion.index}" if len(out.outputs) > 1 else "")
                    score = f" logprob {completion.cumulative_logprob:.2f}" if params.use_beam_search else ""
                    print(f"--- [{label}]{score} {args.prompts[int(out.request_id)]!r}")
                    print(shown(completion))
            if out.finished:
                for completion in out.outputs:
                    generated += len(completion.token_ids)
                    if completion.error:
                        print(f"nanoserve: request {out.request_id} failed: {completion.error}", file=sys.stderr)
    if args.stats:
        print_stats(engine, steps, generated, time.perf_counter() - t0)


def is_byte_level(engine) -> bool:
    """A tiny random model's byte tokenizer (token id = byte value): its output is printed as escaped bytes."""
    from nanoserve.models.resolve import TINY_MODELS

    return engine.config.model in TINY_MODELS


def print_stats(engine, steps: int, generated: int, elapsed: float) -> None:
    print(f"nanoserve: {plural(steps, 'step')}, {plural(generated, 'token')} in {elapsed:.2f} s "
          f"({generated / elapsed:.1f} tokens/s on {plural(engine_threads(), 'thread')})", file=sys.stderr)
    print(f"nanoserve: ran the {engine.implementation.summary()}", file=sys.stderr)
    cache = engine.prefix_cache_stats()
    if cache["num_hit_tokens"]:
        print(f"nanoserve: prefix cache reused {cache['num_hit_tokens']}/{cache['num_lookup_tokens']} prompt "
              f"tokens ({cache['hit_rate']:.0%})", file=sys.stderr)
    spec = engine.spec_stats()
    if spec["num_drafted"]:
        print(f"nanoserve: speculative decoding accepted {spec['num_accepted']}/{spec['num_drafted']} drafted "
              f"tokens ({spec['acceptance_rate']:.0%}), {spec['tokens_per_forward']:.2f} tokens per forward",
              file=sys.stderr)


def engine_threads() -> int:
    import torch
    return torch.get_num_threads()
