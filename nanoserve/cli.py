"""The `nanoserve` command line.

    nanoserve generate --model smollm2 --chat "What is a KV cache?"
    nanoserve generate --model tiny-llama --max-tokens 20 "Hello" "Bonjour"
    nanoserve record --scenario memory-pressure -o pressure.jsonl
    nanoserve export --trace pressure.jsonl --step 12 --what tables --format svg
    nanoserve tui --replay pressure.jsonl        (or: nanoserve tui --model smollm2)
    nanoserve serve --model smollm2              (then: nanoserve tui --attach http://127.0.0.1:8000)

One prompt streams its text as it is generated; several prompts run as one
continuous batch and print each completion as it finishes. Bad input (an
unknown model, a bad setting) prints one clear line and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from nanoserve.models.loader import ACCEPTED, TINY_MODELS, resolve_model_path
from nanoserve.scenarios import SCENARIOS
from nanoserve.serve.command import add_serve_parser, run_serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoserve",
        description="A small LLM serving engine built to be watched: paged KV cache, continuous batching, "
                    "chunked prefill, preemption, and an event for every decision.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate", help="generate text for one or more prompts (streams a single prompt)",
        description="Generate completions. One prompt streams its text; several run as one continuous batch.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several prompts are batched)")
    gen.add_argument("--model", "-m", default="tiny-llama", help=f"model to run: {ACCEPTED} (default: %(default)s)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("-n", type=int, default=None,
                     help="completions per prompt, forked from one prefill (default: 1, or every beam)")
    gen.add_argument("--beam-width", type=int, default=0,
                     help="beam search with this many beams (needs --temperature 0; default: off)")
    gen.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    gen.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: fill 256 MB)")
    gen.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (default: %(default)s)")
    gen.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    gen.add_argument("--no-prefix-caching", action="store_true", help="turn the radix prefix cache off")
    gen.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute",
                     help="what happens to a preempted request's KV (default: %(default)s)")
    gen.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                     help="speculative decoding: n-gram prompt lookup, or a draft model (default: off)")
    gen.add_argument("--num-speculative-tokens", "-k", type=int, default=4,
                     help="tokens drafted per step with --speculative (default: %(default)s)")
    gen.add_argument("--draft-model", default=None,
                     help="draft model for --speculative draft (default: the target's first --draft-layers layers)")
    gen.add_argument("--draft-layers", type=int, default=2, help="layers of the truncated draft (default: %(default)s)")
    gen.add_argument("--stats", action="store_true", help="print steps, tokens and throughput at the end")

    rec = sub.add_parser(
        "record", help="run a scenario on a model and record its events to a JSONL trace",
        description="Run a scenario (a small workload that makes one mechanism happen) and write every "
                    "event to a JSONL trace that `nanoserve tui --replay` and `nanoserve export` read.",
    )
    rec.add_argument("--scenario", "-s", required=True, help=f"one of: {', '.join(SCENARIOS)}")
    rec.add_argument("--output", "-o", required=True, help="trace file to write (.jsonl)")
    rec.add_argument("--model", "-m", default="tiny-llama", help="model to run (default: %(default)s)")

    exp = sub.add_parser(
        "export", help="draw the block tables, the pool or the radix tree at one step of a trace",
        description="Render the engine's state at step N of a recorded trace with Graphviz. Without the "
                    "`dot` program the DOT source is written instead.",
    )
    exp.add_argument("--trace", "-t", required=True, help="a trace written by `nanoserve record`")
    exp.add_argument("--step", "-n", type=int, default=None, help="state after this step (default: the last)")
    exp.add_argument("--what", "-w", choices=["tables", "pool", "radix"], default="tables",
                     help="what to draw (default: %(default)s)")
    exp.add_argument("--format", "-f", choices=["svg", "png", "dot"], default="svg", help="(default: %(default)s)")
    exp.add_argument("--output", "-o", default=None, help="file to write (default: <trace>-<what>-<step>.<format>)")

    tui = sub.add_parser(
        "tui", help="watch a live engine (or replay a trace) in the terminal",
        description="A terminal UI over a live engine running in a worker thread, or over a recorded trace "
                    "(no model needed). Press ? inside for the keys.",
    )
    src = tui.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None, help="run this model live (default: tiny-llama)")
    src.add_argument("--replay", "-r", default=None, metavar="TRACE", help="replay a recorded trace")
    src.add_argument("--attach", default=None, metavar="URL", help="watch a running `nanoserve serve` (read-only)")
    tui.add_argument("--scenario", "-s", default=None, help=f"start a live run with a scenario: {', '.join(SCENARIOS)}")
    tui.add_argument("--api-key", default=None, help="with --attach: the server's API key (default: $NANOSERVE_API_KEY)")

    add_serve_parser(sub)
    return parser


def cmd_record(args: argparse.Namespace) -> int:
    from nanoserve.scenarios import get_scenario, record

    get_scenario(args.scenario)                       # a bad name fails before the model loads
    steps = record(args.scenario, args.output, args.model)
    print(f"nanoserve: recorded {steps} steps of {args.scenario!r} to {args.output}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from nanoserve.viz.graphviz import export_trace

    path = export_trace(args.trace, args.step, args.what, args.format, args.output)
    print(f"nanoserve: wrote {path}", file=sys.stderr)
    return 0


def cmd_tui(args: argparse.Namespace) -> int:
    try:
        from nanoserve_tui.app import run_app
    except ImportError as exc:
        raise ValueError(f"the TUI needs textual: pip install -e '.[tui]' ({exc})") from exc
    if args.attach is not None:
        from nanoserve_tui.attach_app import run_attach
        return run_attach(args.attach, args.api_key, scenario=args.scenario)
    if args.scenario is not None:
        from nanoserve.scenarios import get_scenario
        get_scenario(args.scenario)
    if args.model is not None and args.model not in TINY_MODELS:
        resolve_model_path(args.model, convert=False)   # a bad name fails here, before the app starts
    return run_app(model=args.model, replay=args.replay, scenario=args.scenario)


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from nanoserve import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                          max_num_batched_tokens=args.max_batched_tokens, device=args.device,
                          speculative_method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                          draft_model=args.draft_model, draft_num_layers=args.draft_layers,
                          enable_prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, beam_width=args.beam_width,
                            n=args.n if args.n is not None else max(args.beam_width, 1))
    engine = LLMEngine(config)
    prompts = args.prompts
    if args.chat:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError(f"model {args.model!r} has no chat template; drop --chat")
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    stream = len(prompts) == 1 and params.n == 1 and not params.use_beam_search
    t0, steps, generated = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        for out in result.outputs:
            if stream:
                print(out.outputs[0].delta, end="", flush=True)
                if out.finished:
                    print()
            elif out.finished:
                for completion in out.outputs:
                    label = f"{out.request_id}" + (f".{completion.index}" if len(out.outputs) > 1 else "")
                    score = f" logprob {completion.cumulative_logprob:.2f}" if params.use_beam_search else ""
                    print(f"--- [{label}]{score} {args.prompts[int(out.request_id)]!r}")
                    print(completion.text)
            if out.finished:
                for completion in out.outputs:
                    generated += len(completion.token_ids)
                    if completion.error:
                        print(f"nanoserve: request {out.request_id} failed: {completion.error}", file=sys.stderr)
    if args.stats:
        elapsed = time.perf_counter() - t0
        print(f"nanoserve: {steps} steps, {generated} tokens in {elapsed:.2f} s "
              f"({generated / elapsed:.1f} tok/s)", file=sys.stderr)
        cache = engine.prefix_cache_stats()
        if cache["num_hit_tokens"]:
            print(f"nanoserve: prefix cache reused {cache['num_hit_tokens']}/{cache['num_lookup_tokens']} prompt "
                  f"tokens ({cache['hit_rate']:.0%})", file=sys.stderr)
        spec = engine.spec_stats()
        if spec["num_drafted"]:
            print(f"nanoserve: speculative decoding accepted {spec['num_accepted']}/{spec['num_drafted']} drafted "
                  f"tokens ({spec['acceptance_rate']:.0%}), {spec['tokens_per_forward']:.2f} tokens per forward",
                  file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    commands = {"generate": cmd_generate, "record": cmd_record, "export": cmd_export, "tui": cmd_tui,
                "serve": run_serve}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:   # bad input: one clear line, no traceback wall
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
