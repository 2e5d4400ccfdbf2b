"""The `nanoserve` command line.

    nanoserve generate --model smollm2 --chat "What is a KV cache?"
    nanoserve generate --model tiny-llama --max-tokens 20 "Hello" "Bonjour"
    nanoserve generate --model smollm2 --chat --choice yes,no "Is the sky blue?"
    nanoserve record --scenario memory-pressure -o pressure.jsonl
    nanoserve export --trace pressure.jsonl --step 12 --what tables --format svg
    nanoserve tui --replay pressure.jsonl        (or: nanoserve tui --model smollm2)
    nanoserve serve --model smollm2              (then: nanoserve tui --attach http://127.0.0.1:8000)
    nanoserve web --replay pressure.jsonl        (the TUI in a browser; also live, --attach, --compare)
    nanoserve export --trace pressure.jsonl --format html -o replay.html   (a page that replays every step)
    nanoserve compare --scenario memory-pressure --set preemption_mode=swap
    nanoserve plot --trace pressure.jsonl --what blocks -o blocks.png
    nanoserve lab start block-pool               (then: nanoserve lab check block-pool)
    nanoserve bench roofline --dtype bfloat16 -o roofline.png   (how close a decode step is to memory's speed)

One prompt streams its text as it is generated; several prompts run as one
continuous batch and print each completion as it finishes.

Bad input (an unknown model, a bad setting, a broken file) prints one line
that names what was wrong, by its flag, and exits with code 2. Every command
that builds an engine has a flag for each `EngineConfig` field, made from the
dataclass (engine_flags.py); `generate`'s sampling flags store into dests
named after `SamplingParams` fields. So building the config and naming the
flag in an error both come from the same definitions.

Nothing heavy is imported at the top: `nanoserve --help` and the error paths
never load torch or transformers.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from nanoserve.cli_generate import add_structured_flags, run_generate, say, structured_flags
from nanoserve.engine_flags import add_engine_flags, engine_settings
from nanoserve.errors import FieldError
from nanoserve.labs.plug import components_from
from nanoserve.models.default import HELP as MODEL_HELP
from nanoserve.models.default import LIVE_HELP, default_model, model_note
from nanoserve.models.resolve import TINY_MODELS, resolve_model_path
from nanoserve.roofline import add_bench_parser, cmd_bench
from nanoserve.scenarios import SCENARIOS
from nanoserve.serve.command import add_serve_parser
from nanoserve.threads import THREADS_ENV, apply_thread_policy
from nanoserve.trace import TraceWarning
from nanoserve_labkit.command import add_lab_parser, cmd_lab
from nanoserve_tui.web_command import add_web_parser

ENGINE_GROUP, SAMPLING_GROUP = "engine", "sampling"   # `generate`'s argument groups
SCENARIO_ENGINE = "settings over the scenario's (EngineConfig fields; engine_flags.py)"


def add_lab_option(parser) -> None:
    parser.add_argument("--lab", action="append", default=None, metavar="NAME=FILE|DIR",
                        help="run the engine with your solution of a lab, e.g. block-pool=block_pool.py, or with "
                             "every part in your capstone folder DIR (repeatable; see `nanoserve lab list`)")


def add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"torch threads (default: ${THREADS_ENV}, else the CPU cores free right now)")


class VersionAction(argparse.Action):
    """`--version`: the installed version, read only when asked (importlib.metadata is not free)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import nanoserve

        print(f"nanoserve {nanoserve.__version__}")   # (stdout, as argparse's own version action)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoserve",
        description="A small LLM serving engine built to be watched: paged KV cache, continuous batching, "
                    "chunked prefill, preemption, and an event for every decision.",
    )
    parser.add_argument("--version", action=VersionAction, help="print nanoserve's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate", help="generate text for one or more prompts (streams a single prompt)",
        description="Generate completions. One prompt streams its text; several run as one continuous batch.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several prompts are batched)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--stats", action="store_true", help="print steps, tokens and throughput at the end")
    add_lab_option(gen)
    add_threads(gen)
    # The engine group's flags are EngineConfig's fields (engine_flags.py); the sampling group's store into
    # dests named after SamplingParams' fields (`group_kwargs` reads them).
    eng = gen.add_argument_group(ENGINE_GROUP, "settings of the engine (EngineConfig fields)")
    add_engine_flags(eng, renamed={"seed": "engine_seed"})    # --seed is a request's (SamplingParams)
    smp = gen.add_argument_group(SAMPLING_GROUP, "how each prompt is completed (SamplingParams fields)")
    smp.add_argument("--max-tokens", dest="max_tokens", type=int, default=64, metavar="N",
                     help="tokens to generate per prompt (default: %(default)s)")
    smp.add_argument("--temperature", dest="temperature", type=float, default=0.0, metavar="T",
                     help="0 is greedy: the same text every run (default: %(default)s)")
    smp.add_argument("--top-p", dest="top_p", type=float, default=1.0, metavar="P",
                     help="nucleus sampling mass (default: %(default)s)")
    smp.add_argument("--top-k", dest="top_k", type=int, default=0, metavar="K",
                     help="keep the k most likely tokens, 0 = all (default: %(default)s)")
    smp.add_argument("--seed", dest="seed", type=int, default=None, help="per-request seed for reproducible sampling")
    smp.add_argument("--stop", dest="stop", action="append", default=[], help="stop string (repeatable)")
    smp.add_argument("-n", dest="n", type=int, default=None,
                     help="completions per prompt, forked from one prefill (default: 1, or every beam)")
    smp.add_argument("--beam-width", dest="beam_width", type=int, default=None, metavar="N",
                     help="beam search with this many beams (needs --temperature 0; default: off)")
    add_structured_flags(gen)

    rec = sub.add_parser(
        "record", help="run a scenario on a model and record its events to a JSONL trace",
        description="Run a scenario (a small workload that makes one mechanism happen) and write every "
                    "event to a JSONL trace that `nanoserve tui --replay` and `nanoserve export` read.",
    )
    rec.add_argument("--scenario", "-s", required=True, help=f"one of: {', '.join(SCENARIOS)}")
    rec.add_argument("--output", "-o", required=True, help="trace file to write (.jsonl)")
    rec.add_argument("--model", "-m", dest="model", default=None, help=MODEL_HELP)
    add_lab_option(rec)
    add_threads(rec)
    add_engine_flags(rec.add_argument_group(ENGINE_GROUP, SCENARIO_ENGINE), own=("model",))

    exp = sub.add_parser(
        "export", help="draw the block tables, the pool or the radix tree at one step of a trace, "
                       "or the whole trace as a web page",
        description="Render the engine's state at step N of a recorded trace with Graphviz. svg and png need "
                    "its `dot` program (without it: one line saying so, exit 2); --format dot writes the DOT "
                    "source, no Graphviz needed. --format html writes one self-contained "
                    "page that replays every step as the TUI draws it (slider, arrow keys; no network).",
    )
    exp.add_argument("--trace", "-t", required=True, help="a trace written by `nanoserve record`")
    exp.add_argument("--step", "-n", type=int, default=None,
                     help="state after this step (default: the last; html: the step the page opens at)")
    exp.add_argument("--what", "-w", choices=["tables", "pool", "radix"], default=None,
                     help="what to draw (default: tables; html shows the whole TUI)")
    exp.add_argument("--format", "-f", choices=["svg", "png", "dot", "html"], default="svg",
                     help="(default: %(default)s)")
    exp.add_argument("--output", "-o", default=None,
                     help="file to write (default: <trace>-<what>-<step>.<format>, html: <trace>-replay.html)")

    tui = sub.add_parser(
        "tui", help="watch a live engine (or replay a trace) in the terminal",
        description="A terminal UI over a live engine running in a worker thread, or over a recorded trace "
                    "(no model needed). Press ? inside for the keys.",
    )
    src = tui.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", dest="model", default=None, help=LIVE_HELP)
    src.add_argument("--replay", "-r", default=None, metavar="TRACE", help="replay a recorded trace")
    src.add_argument("--attach", default=None, metavar="URL", help="watch a running `nanoserve serve` (read-only)")
    tui.add_argument("--scenario", "-s", default=None, help=f"start a live run with a scenario: {', '.join(SCENARIOS)}")
    tui.add_argument("--api-key", default=None, help="with --attach: the server's API key (default: $NANOSERVE_API_KEY)")
    add_lab_option(tui)
    add_threads(tui)
    add_engine_flags(tui.add_argument_group(ENGINE_GROUP, SCENARIO_ENGINE), own=("model",))

    add_threads(add_serve_parser(sub))
    add_web_parser(sub)
    add_whatif_parsers(sub)
    add_lab_parser(sub)
    add_bench_parser(sub)
    return parser


def add_whatif_parsers(sub) -> None:
    """`compare` and `plot` (nanoserve/whatif/)."""
    from nanoserve.whatif.plots import FIGURES

    cmp = sub.add_parser(
        "compare", help="run a scenario twice (as written, and with --set changes) or read two traces; "
                        "print what differs",
        description="Compare two runs of the same workload: whole-run totals (blocks, tokens computed, prefix "
                    "hits, preemptions, swaps, CoW copies), per-request first-token and finish steps, and the "
                    "first step where the runs diverge.",
    )
    cmp.add_argument("--scenario", "-s", default=None, help=f"one of: {', '.join(SCENARIOS)}")
    cmp.add_argument("--set", dest="set", action="append", default=[], metavar="KEY=VALUE",
                     help="an engine setting run B changes, e.g. preemption_mode=swap (repeatable)")
    cmp.add_argument("--trace", "-t", dest="trace", action="append", default=[], metavar="FILE",
                     help="instead of --scenario: two recorded traces (give --trace twice)")
    cmp.add_argument("--model", "-m", dest="model", default=None, help=MODEL_HELP)
    cmp.add_argument("--save", default=None, metavar="PREFIX",
                     help="also write both runs' traces: PREFIX-a.jsonl and PREFIX-b.jsonl")
    cmp.add_argument("--tui", action="store_true",
                     help="show the two runs side by side in the terminal UI, in lockstep (keys: space, b, d)")
    add_threads(cmp)
    add_engine_flags(cmp.add_argument_group(ENGINE_GROUP, "settings of both runs, over the scenario's "
                                                          "(EngineConfig fields)"), own=("model",))

    plot = sub.add_parser(
        "plot", help="draw a figure of a recorded trace with matplotlib (PNG or SVG)",
        description="Plot a trace: " + "; ".join(f"{name}: {fig.title}" for name, fig in FIGURES.items()),
    )
    plot.add_argument("--trace", "-t", required=True, help="a trace written by `nanoserve record`")
    plot.add_argument("--what", "-w", choices=list(FIGURES), default="blocks", help="(default: %(default)s)")
    plot.add_argument("--output", "-o", required=True, help="file to write: .png or .svg")


# -- errors: one line, by flag ------------------------------------------------------------


def field_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> its flag (the long one), e.g. {"max_num_batched_tokens": "--max-batched-tokens"}, from `parser`."""
    flags = {}
    for action in parser._actions:           # argparse keeps no public list of a parser's arguments
        if action.option_strings:
            long = [s for s in action.option_strings if s.startswith("--")]
            flags[action.dest] = (long or action.option_strings)[0]
    return flags


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices[command]


def error_line(exc: BaseException, flags: dict[str, str]) -> str:
    """The one line we print for a bad input: a FieldError names its flag; other text is joined into one line."""
    if isinstance(exc, FieldError):
        text = f"{flags.get(exc.field, exc.field)} {exc.text}"
    elif isinstance(exc, OSError) and exc.strerror and exc.filename:
        text = f"{exc.strerror}: {exc.filename}"
    else:
        text = str(exc) or type(exc).__name__
    return "nanoserve: error: " + " ".join(text.split("\n"))


def check_output(path: str, flag: str) -> None:
    """A file we may write: not a directory, in a directory that exists."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file in it, e.g. {target / 'trace.jsonl'}")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {target.parent} does not exist")


# -- commands -------------------------------------------------------------------------------


def cmd_record(args: argparse.Namespace) -> int:
    from nanoserve.scenarios import get_scenario, record

    get_scenario(args.scenario)                       # a bad name fails before the model loads
    check_output(args.output, "--output")
    components = components_from(args.lab)
    threads = apply_thread_policy(args.threads)
    model = pick_model(args)
    steps = record(args.scenario, args.output, model, components=components, settings=engine_settings(args))
    say(threads.note())
    print(f"nanoserve: recorded {steps} steps of {args.scenario!r} to {args.output}", file=sys.stderr)
    return 0


def pick_model(args: argparse.Namespace, tell: bool = True) -> str:
    """`--model`, or the default (SmolLM2 when installed); says which in one line (`tell`)."""
    model = args.model or default_model()
    if tell:
        say(model_note(model, named=args.model is not None))
    return model


def cmd_export(args: argparse.Namespace) -> int:
    if args.output is not None:
        check_output(args.output, "--output")
    if args.format == "html":
        return export_replay(args)
    from nanoserve.viz.graphviz import export_trace

    path = export_trace(args.trace, args.step, args.what or "tables", args.format, args.output)
    print(f"nanoserve: wrote {path}", file=sys.stderr)
    return 0


def export_replay(args: argparse.Namespace) -> int:
    """`export --format html`: the trace as one web page of the TUI's own frames (tui/replay_html.py)."""
    if args.what is not None:
        raise FieldError("what", "does not apply to --format html: the page shows the whole TUI at every step")
    from nanoserve_tui.replay_html import BUDGET_BYTES, export_html

    replay = export_html(args.trace, args.output, args.step)
    if replay.sampled:
        print(f"nanoserve: the trace has {replay.total_steps} steps; the page shows {len(replay.steps)} of them, "
              f"evenly spaced, to stay under {BUDGET_BYTES / 1e6:g} MB", file=sys.stderr)
    print(f"nanoserve: wrote {replay.path} ({replay.size / 1e6:.1f} MB, {len(replay.steps)} steps; "
          "open it in a browser: arrow keys or the slider)", file=sys.stderr)
    return 0


def cmd_tui(args: argparse.Namespace) -> int:
    if args.scenario is not None:
        from nanoserve.scenarios import get_scenario
        get_scenario(args.scenario)
    if args.replay is None and args.attach is None:
        args.model = pick_model(args, tell=False)      # (the TUI's status bar says which: "playground on smollm2")
    if args.model is not None and args.model not in TINY_MODELS:
        resolve_model_path(args.model, convert=False)   # a bad name fails here, before the app starts
    try:
        from nanoserve_tui.app import run_app
        from nanoserve_tui.attach_app import run_attach
    except ImportError as exc:
        raise ValueError(f"the TUI could not be imported ({exc}); it needs textual: "
                         "pip install 'textual>=0.80', or reinstall nanoserve (pip install .)") from exc
    if args.attach is not None:
        if args.lab:
            raise FieldError("lab", "needs a live engine; --attach watches a server's engine")
        return run_attach(args.attach, args.api_key, scenario=args.scenario)
    if args.lab and args.replay is not None:
        raise FieldError("lab", "needs a live engine; --replay plays a recorded trace")
    settings = engine_settings(args)
    if settings and (args.replay is not None or args.attach is not None):
        raise FieldError(next(iter(settings)), "needs a live engine (a trace or a server says its own settings)")
    components = components_from(args.lab)
    say(apply_thread_policy(args.threads).note())
    explain = None
    if components is not None:                 # a step that fails in the student's part: said as the checks would
        from nanoserve.labs.plug import explain_failure as explain
    return run_app(model=args.model, replay=args.replay, scenario=args.scenario, components=components,
                   overrides=settings or None, explain=explain)


def cmd_web(args: argparse.Namespace) -> int:
    if args.replay is None and args.attach is None and args.compare is None:
        args.model = pick_model(args, tell=False)      # (its first line says which: "playground on smollm2")
    if args.model is not None and args.model not in TINY_MODELS:
        resolve_model_path(args.model)   # a bad name fails here, not in every browser tab; a GGUF converts once
    from nanoserve_tui.web_command import run_web
    return run_web(args)


def cmd_compare(args: argparse.Namespace) -> int:
    from nanoserve.whatif.settings import parse_sets

    if (args.scenario is None) == (not args.trace):
        raise FieldError("scenario", "or two --trace files: give one of them (e.g. --scenario memory-pressure "
                                     "--set preemption_mode=swap)")
    if args.trace:
        if len(args.trace) != 2 or args.set:
            raise FieldError("trace", "must be given exactly twice (A and B), without --set")
        from nanoserve.trace_check import load_trace
        from nanoserve.whatif.compare import compare
        events = [load_trace(t) for t in args.trace]
        return show_comparison(compare(*events, labels=tuple(Path(t).stem for t in args.trace)), *events, args.tui)
    from nanoserve.scenarios import get_scenario
    from nanoserve.whatif.workload import scenario_pair

    get_scenario(args.scenario)
    changes = parse_sets(args.set)                    # a bad --set fails before the model loads
    if args.save is not None:
        check_output(args.save + "-a.jsonl", "--save")
    say(apply_thread_policy(args.threads).note())
    a, b = scenario_pair(args.scenario, changes, pick_model(args, tell=False), settings=engine_settings(args))
    pick_model(args)                                  # which model ran: said once both runs worked
    if args.save is not None:
        from nanoserve.trace import write_trace
        write_trace(args.save + "-a.jsonl", a.events)
        write_trace(args.save + "-b.jsonl", b.events)
    from nanoserve.whatif.compare import compare
    return show_comparison(compare(a, b), a.events, b.events, args.tui)


def show_comparison(comparison, events_a, events_b, tui: bool) -> int:
    """Print the comparison, or open it side by side in the TUI."""
    if not tui:
        print(comparison)
        return 0
    from nanoserve_tui.compare_app import run_compare_app
    return run_compare_app(comparison, events_a, events_b)


def cmd_plot(args: argparse.Namespace) -> int:
    from nanoserve.whatif.plots import save_figure

    check_output(args.output, "--output")
    if Path(args.output).suffix.lower() not in (".png", ".svg"):
        raise FieldError("output", f"must end in .png or .svg, got {args.output}")
    save_figure(args.trace, args.what, args.output)
    print(f"nanoserve: wrote {args.output}", file=sys.stderr)
    return 0


def group_kwargs(parser: argparse.ArgumentParser, title: str, args: argparse.Namespace) -> dict:
    """The values of the flags in argument group `title`, by dest: a dataclass's keyword arguments."""
    group = next(g for g in parser._action_groups if g.title == title)
    return {a.dest: getattr(args, a.dest) for a in group._group_actions}


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.validation import well_formed

    parser = subparser(build_parser(), "generate")
    sampling = group_kwargs(parser, SAMPLING_GROUP, args)
    if sampling["beam_width"] is None:                # left out: no beam search (SamplingParams' 0)
        sampling["beam_width"] = 0
    elif sampling["beam_width"] < 1:                  # asked for, with no beams: a typo, not "off"
        raise FieldError("beam_width", f"must be at least 1 (leave it out for no beam search), got "
                                       f"{sampling['beam_width']}")
    if sampling["n"] is None:
        sampling["n"] = max(sampling["beam_width"], 1)
    params = SamplingParams(**sampling, structured_outputs=structured_flags(args))   # bad settings fail before
                                                                                     # the model loads
    for i, prompt in enumerate(args.prompts):         # ... and so does a prompt with a byte that is not UTF-8
        well_formed("PROMPT" if len(args.prompts) == 1 else f"PROMPT {i + 1}", prompt)
    config = EngineConfig(**engine_settings(args))   # the flags given; the dataclass's defaults for the rest
    components = components_from(args.lab)            # a student's file that does not load fails here
    threads = apply_thread_policy(args.threads)
    from nanoserve.engine import LLMEngine

    with LLMEngine(config, components=components) as engine:                 # (the end stops a tensor-parallel engine's workers)
        run_generate(engine, args, params, threads)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoserve.serve.command import run_serve

    apply_thread_policy(args.threads)
    return run_serve(args)


COMMANDS = {"generate": cmd_generate, "record": cmd_record, "export": cmd_export, "tui": cmd_tui,
            "serve": cmd_serve, "web": cmd_web, "compare": cmd_compare, "plot": cmd_plot,
            "lab": cmd_lab, "bench": cmd_bench}


def show_warning(message, category, *args, _default=warnings.showwarning, **kwargs) -> None:
    """A repaired trace (its cut last line left out) says so in one line; other warnings as Python shows them."""
    if issubclass(category, TraceWarning):
        print(f"nanoserve: warning: {message}", file=sys.stderr)
    else:
        _default(message, category, *args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = show_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    command = subparser(parser, args.command)
    if args.command in ("lab", "bench"):             # flags live one level down: `lab check --time-limit`
        command = subparser(command, getattr(args, f"{args.command}_command"))
    flags = field_flags(command)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError, RuntimeError) as exc:   # bad input: one clear line, no traceback wall
        print(error_line(exc, flags), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
