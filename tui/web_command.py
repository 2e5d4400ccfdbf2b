"""`nanoserve web`: the TUI in a web browser, one app per tab (textual-serve).

    nanoserve web --replay pressure.jsonl           a trace: every tab steps its own copy
    nanoserve web --scenario memory-pressure        live: every tab runs its own engine
    nanoserve web --attach http://127.0.0.1:8000    a server: every tab watches the same engine
    nanoserve web --compare a.jsonl b.jsonl         two traces side by side (`nanoserve compare --save`)
    nanoserve web --replay p.jsonl --host 0.0.0.0 --api-key s3cret    on a classroom network

Every tab runs the same program as the terminal does (`nanoserve tui ...`,
`nanoserve compare --trace ... --tui`), as its own process, so every key and
panel works as it does there. What a tab costs is what that program costs:
a replay, a comparison or an attached view imports no torch (about 60 MB and
a second to start); a live engine loads torch and the model in every tab.
So the class case is cheap by construction: one `nanoserve serve` that
everyone's tab `--attach`es to (one engine, a thin viewer per tab), or one
trace that every tab replays. Live tabs run one torch thread each and get
fewer seats by default (`--max-sessions`).

This module owns the flags, the checks made before anything is served (a
bad trace or model, a busy port: one line, exit 2) and what the user is told,
including who can reach the page. The server itself is web_server.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys

from nanoserve.engine_flags import add_engine_flags, command_line, engine_settings
from nanoserve.models.default import LIVE_HELP, default_model
from nanoserve.serve.command import API_KEY_ENV, is_loopback

SEATS = {"live": 4, "replay": 40, "compare": 40, "attach": 40}   # default --max-sessions, an app per tab
SHARED_SEATS = 200                                              # ... and with --shared (a websocket each)


def add_web_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "web", help="serve the TUI to web browsers: live, --replay, --compare or --attach",
        description="The terminal UI in a web browser (textual-serve): each browser tab runs the same app as "
                    "`nanoserve tui`, every key and panel included. 127.0.0.1 by default: this machine only.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None, help=LIVE_HELP.replace("live", "live in every tab", 1))
    src.add_argument("--replay", "-r", default=None, metavar="TRACE", help="replay a recorded trace")
    src.add_argument("--attach", default=None, metavar="URL", help="watch a running `nanoserve serve` (read-only)")
    src.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"),
                     help="two traces side by side, in lockstep (e.g. from `nanoserve compare --save`)")
    p.add_argument("--scenario", "-s", default=None, help="start the live run with a scenario")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine "
                                                       "only; 0.0.0.0: every network it is on)")
    p.add_argument("--port", "-p", type=int, default=8080, help="(default: %(default)s)")
    p.add_argument("--api-key", default=None, help=f"require this key of every browser (default: ${API_KEY_ENV} "
                                                   "if set); with --attach also sent to the server")
    p.add_argument("--shared", action=argparse.BooleanOptionalAction, default=None,
                   help="one app for every tab, drawn once; keys only from this machine's browser (default: on "
                        "with --attach, off otherwise: each tab steps its own copy)")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N",
                   help="browser tabs served at once, one app process each (default: "
                        + ", ".join(f"{n} {mode}" for mode, n in SEATS.items()) + ")")
    add_engine_flags(p.add_argument_group("engine", "live mode: every tab's engine settings, over the scenario's "
                                                    "(EngineConfig fields)"), own=("model",))
    return p


def mode_of(args: argparse.Namespace) -> str:
    return ("replay" if args.replay else "attach" if args.attach else "compare" if args.compare else "live")


def tab_command(args: argparse.Namespace) -> list[str]:
    """What every tab runs: the terminal's own command line."""
    me = [sys.executable, "-m", "nanoserve"]
    mode = mode_of(args)
    if mode == "replay":
        return [*me, "tui", "--replay", os.path.abspath(args.replay)]
    if mode == "attach":
        return [*me, "tui", "--attach", args.attach]      # the key goes by $NANOSERVE_API_KEY, not in `ps`
    if mode == "compare":
        a, b = (os.path.abspath(t) for t in args.compare)
        return [*me, "compare", "--trace", a, "--trace", b, "--tui"]
    live = [*me, "tui", "--threads", "1"]                 # many tabs share the cores: one torch thread each
    if args.model:
        live += ["--model", args.model]
    return live + (["--scenario", args.scenario] if args.scenario else []) + command_line(engine_settings(args))


def check(args: argparse.Namespace) -> str:
    """Refuse what would fail in every tab, before serving (ValueError / OSError, one line); returns a title."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_sessions is not None and args.max_sessions < 1:
        raise ValueError(f"--max-sessions must be at least 1, got {args.max_sessions}")
    mode = mode_of(args)
    if args.scenario is not None and mode != "live":
        raise ValueError(f"--scenario starts a live engine; --{mode} takes none")
    if engine_settings(args) and mode != "live":
        raise ValueError(f"engine flags set a live engine; --{mode} takes none")
    if mode == "replay":
        from nanoserve_tui.source import replay_source
        replay_source(args.replay)                        # the TUI's own check of the trace
        return f"nanoserve: replay of {os.path.basename(args.replay)}"
    if mode == "compare":
        from nanoserve_tui.source import replay_source
        for trace in args.compare:
            replay_source(trace)
        return "nanoserve: " + " vs ".join(os.path.basename(t) for t in args.compare)
    if mode == "attach":
        from nanoserve_tui.attach import AttachSource
        AttachSource(args.attach, None)                   # a URL that is not one fails here
        return f"nanoserve: attached to {args.attach}"
    from nanoserve.scenarios import get_scenario
    if args.scenario is not None:
        get_scenario(args.scenario)                       # (the model's name: cli.py checks it, as for `tui`)
    return f"nanoserve: {args.scenario or 'playground'} on {args.model or default_model()}"


def lan_address() -> str | None:
    """This machine's address on its network (the route a packet would take; none is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.254.254.254", 1))
            return probe.getsockname()[0]
    except OSError:
        return None


def who_can_reach(host: str, port: int, api_key: str | None) -> list[str]:
    """The lines that say where the page is and who can open it."""
    if is_loopback(host):
        return [f"open http://{host}:{port} in a browser: only this machine can (--host 0.0.0.0 shares it "
                "on your network)"]
    shown = lan_address() if host in ("0.0.0.0", "::") else host
    url = f"http://{shown or host}:{port}"
    if api_key:
        return [f"listening on {host}:{port}: anyone on a network that reaches this machine can load {url}, "
                f"and only with the key: give them {url}/?key=KEY (your key)"]
    return [f"warning: listening on {host}:{port} without a key: anyone on a network that reaches this machine "
            f"can open {url} and use the app; set --api-key or ${API_KEY_ENV}"]


def run_web(args: argparse.Namespace) -> int:
    title = check(args)
    try:
        from nanoserve_tui.web_server import WebServer
    except ImportError as exc:
        raise RuntimeError(f"`nanoserve web` needs {exc.name}: pip install textual-serve (it comes with "
                           "`pip install nanoserve`)") from None
    mode = mode_of(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if mode == "attach" and api_key:
        os.environ[API_KEY_ENV] = api_key                 # the tabs' `tui --attach` reads it from there
    try:   # bind first: a port in use is one line
        sock = socket.create_server((args.host, args.port), reuse_port=False)
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    shared = args.shared if args.shared is not None else mode == "attach"
    seats = args.max_sessions or (SHARED_SEATS if shared else SEATS[mode])
    if shared:
        note = "one app for every tab, drawn once; keys only from this machine's browser"
    else:
        note = {"live": "every tab loads the model and runs its own engine",
                "attach": "every tab watches the same server"}.get(mode, "every tab steps its own copy")
    server = WebServer(shlex.join(tab_command(args)), title=title, api_key=api_key, max_sessions=seats, note=note,
                       shared=shared)
    port = sock.getsockname()[1]
    say = lambda line: print(f"nanoserve: {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"serving the TUI ({title.removeprefix('nanoserve: ')}) to web browsers; {note} "
        f"(at most {seats} tabs at once)")
    for line in who_can_reach(args.host, port, api_key):
        say(line)
    server.serve_on(sock)
    return 0
