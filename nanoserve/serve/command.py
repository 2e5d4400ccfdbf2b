"""`nanoserve serve`: the command line of the server.

    nanoserve serve --model smollm2
    nanoserve serve --model tiny-llama --port 8001 --step-delay 0.3 --record class.jsonl
    NANOSERVE_API_KEY=s3cret nanoserve serve --model smollm2 --host 0.0.0.0

`add_serve_parser` declares the flags (cli.py calls it), `run_serve` checks
them, binds the socket (a port in use is one clear line, not a uvicorn
traceback, before the model loads), loads the model and runs uvicorn in the
main thread with the settings of `listener.py`. It imports FastAPI
and uvicorn only when the command runs, so `nanoserve --help` stays quick.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from nanoserve.engine_flags import add_engine_flags, engine_settings
from nanoserve.serve.limits import MAX_BODY_BYTES

API_KEY_ENV = "NANOSERVE_API_KEY"


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (watch it with `nanoserve tui --attach URL`)",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), "
                    "plus /events (the engine's events as server-sent events), /snapshot, /health and /metrics.",
    )
    p.add_argument("--model", "-m", default="tiny-llama", help="model to serve (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", "-p", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on every route (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a seat; more get HTTP 429 (default: %(default)s)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to rest after each step, so a classroom can follow (default: %(default)s)")
    p.add_argument("--record", default=None, metavar="FILE", help="write every event to this JSONL trace")
    p.add_argument("--lab", action="append", default=None, metavar="NAME=FILE|DIR",
                   help="serve with your solution of a lab (NAME=FILE), or with every part in your capstone "
                        "folder DIR (repeatable; see `nanoserve lab list`)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_BODY_BYTES, metavar="N",
                   help="largest request body; larger ones get HTTP 413 (default: %(default)s)")
    add_engine_flags(p.add_argument_group("engine", "settings of the engine (EngineConfig fields)"), own=("model",))
    return p


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (localhost, 127.0.0.0/8, ::1): `serve` and `web` warn otherwise."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(args: argparse.Namespace) -> None:
    """Flag values that make no sense, before the model loads (ValueError naming the flag)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    if args.step_delay < 0:
        raise ValueError(f"--step-delay must be >= 0, got {args.step_delay}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}")


def run_serve(args: argparse.Namespace) -> int:
    _check(args)
    try:
        from nanoserve.serve.app import build_app
        from nanoserve.serve.background import Uvicorn
        from nanoserve.serve.listener import listen, raise_open_file_limit, server_config
    except ImportError as exc:
        raise RuntimeError(f"`nanoserve serve` needs {exc.name}: pip install fastapi uvicorn prometheus-client "
                           "(they come with `pip install nanoserve`)") from None
    from nanoserve import EngineConfig, LLMEngine
    from nanoserve.labs.plug import components_from
    from nanoserve.threads import on_a_thread_that_ends

    components = components_from(args.lab)    # a student's file that does not load fails here, before the port
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = EngineConfig(**engine_settings(args), model=args.model)
    try:   # bind first: a port in use should not cost a model load
        sock = listen(args.host, args.port)
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    raise_open_file_limit()   # each connection is an open file: as many as the system allows
    # Built on a thread that ends: the engine thread then holds the process's only OpenMP team (threads.py).
    engine = on_a_thread_that_ends(lambda: LLMEngine(config, components=components))
    app = build_app(engine, model_name=args.served_model_name, api_key=api_key, max_waiting=args.max_waiting,
                    step_delay=args.step_delay, record=args.record, max_request_bytes=args.max_request_bytes)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    say = lambda msg: print(f"nanoserve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if not is_loopback(args.host):
        say(f"warning: listening on {args.host}: anyone who can reach this machine can use the model "
            f"and watch every prompt on /events" + ("" if api_key else f"; set --api-key or ${API_KEY_ENV}"))
    say(f"serving {args.model} as {app.state.server.model_name!r} on {url}  (OpenAI API at {url}/v1)")
    say(f"watch it: nanoserve tui --attach {url}" + (" --api-key ..." if api_key else ""))
    if args.record:
        say(f"recording every event to {args.record}")
    Uvicorn(server_config(app, timeout_graceful_shutdown=10)).run(sockets=[sock])
    return 0
