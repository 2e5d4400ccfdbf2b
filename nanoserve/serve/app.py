"""The ASGI app of `nanoserve serve`: FastAPI routes in front of one engine loop.

    POST /v1/completions, /v1/chat/completions, GET /v1/models    openai_routes.py
    POST /tokenize, /detokenize, /reset_prefix_cache, GET /tokenizer_info, /version   vllm_routes.py
    GET  /events        the engine's events as SSE, in the trace's JSONL schema   event_stream.py
    GET  /snapshot      engine.snapshot(), taken between two steps
    GET  /clients       who is connected (the TUI's clients panel)                clients.py
    GET  /health        200 while the engine loop runs, 503 after it died
    GET  /metrics       Prometheus text format                                    metrics.py

Why FastAPI (on Starlette, served by uvicorn): the request bodies are pydantic
models, so validation, the error's field name and the /docs page come from
the declarations in `protocol.py`; it is also what vLLM and SGLang serve
their OpenAI APIs with, so this code reads like theirs. Streaming uses
Starlette's StreamingResponse, which cancels the body when the client
disconnects: that cancellation is how a hang-up becomes an abort.

`build_app(engine, ...)` wires it up; the lifespan starts the engine loop and
stops it (and closes the --record trace) on shutdown. With an API key, every
route, /events and /metrics included, needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.engine import LLMEngine
from nanoserve.serve.clients import ClientBook
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.serve.errors import install_error_handlers
from nanoserve.serve.event_stream import EventHub, event_stream
from nanoserve.serve.grammars import GrammarCompiles
from nanoserve.serve.limits import MAX_BODY_BYTES, BodyLimit
from nanoserve.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from nanoserve.serve.openai_routes import router as openai_router
from nanoserve.serve.protocol import ApiError, ChatTemplateOptions, template_variables
from nanoserve.serve.vllm_routes import router as vllm_router
from nanoserve.trace import JsonlRecorder

log = logging.getLogger("nanoserve.serve")


class Server:
    """What the routes share: the engine loop, the metrics, the client book, the event hub."""

    def __init__(self, engine: LLMEngine, model_name: str | None = None, max_waiting: int = 64,
                 step_delay: float = 0.0, record: str | Path | None = None) -> None:
        self.engine = engine                        # touched only by the engine thread once started
        self.model_name = model_name or engine.config.model
        self.implementation = engine.implementation.as_dict()   # fixed once the engine is built
        self.tokenizer = engine.tokenizer           # for chat templates and token texts (read-only here)
        self.max_model_len = engine.config.max_model_len
        self.metrics = ServerMetrics(self.model_name)
        self.engine_loop = EngineLoop(engine, self.metrics, max_waiting, step_delay)
        self.grammars = GrammarCompiles(engine)     # structured output's grammars, off the engine thread
        self.hub = EventHub(self.engine_loop)
        self.book = ClientBook()
        self.record = Path(record) if record else None
        self.started = int(time.time())
        self._ids = itertools.count(1)
        self._recorder: JsonlRecorder | None = None

    def start(self) -> None:
        if self.record:                             # before the thread starts: no step can be missed
            self._recorder = JsonlRecorder(self.record)
            try:
                self.engine.subscribe(self._recorder)
            except OSError as exc:                  # (a full disk at once: serve anyway; /health says so)
                log.warning("%s", exc)
        self.engine_loop.start()

    def stop(self) -> None:
        self.engine_loop.stop()
        self.grammars.shutdown()
        if self._recorder:
            self._recorder.close()

    def next_request_id(self, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"

    def chat_prompt(self, dialog: list[dict], options: ChatTemplateOptions | None = None) -> str:
        """The messages through the tokenizer's chat template, ending where the assistant speaks
        (or, with `options`, going on with the last message; with more template variables)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"model {self.model_name!r} has no chat template: use /v1/completions", "messages")
        options = options or ChatTemplateOptions()
        variables = template_variables(self.tokenizer, options.chat_template_kwargs)
        try:
            return self.tokenizer.apply_chat_template(
                dialog, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **variables)
        except Exception as exc:  # noqa: BLE001 -- a template's own error (e.g. roles it refuses)
            raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None


class BearerAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <key>` (constant-time compare)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, *, model_name: str | None = None, api_key: str | None = None,
              max_waiting: int = 64, step_delay: float = 0.0, record: str | Path | None = None,
              max_request_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's ASGI app around `engine` (which it owns from now on)."""
    server = Server(engine, model_name, max_waiting, step_delay, record)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)

    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server you can watch", lifespan=lifespan)
    app.state.server = server
    app.include_router(openai_router)
    app.include_router(vllm_router)

    install_error_handlers(app)       # every error, the framework's included, as an OpenAI-shaped body

    @app.get("/health")
    async def health() -> JSONResponse:
        if server.engine_loop.alive:
            body = {"status": "ok", "model": server.model_name,
                    # what computes the steps, as it runs (LLMEngine.implementation)
                    "implementation": server.implementation}
            if server._recorder is not None and server._recorder.error:   # serving goes on; recording stopped
                body["record"] = f"stopped: {server._recorder.error}"
            return JSONResponse(body)
        return JSONResponse({"status": "error", "error": server.engine_loop.error or "engine loop stopped"}, 503)

    @app.get("/snapshot")
    async def snapshot() -> dict:
        return await asyncio.wrap_future(server.engine_loop.call(lambda e: e.snapshot()))

    @app.get("/clients")
    async def clients() -> dict:
        return server.book.table()

    @app.get("/events")
    async def events(request: Request, clients: bool = False) -> StreamingResponse:
        watcher = await server.hub.watch()
        key = server.book.add_watcher(f"{request.client.host}:{request.client.port}" if request.client else "?")
        body = event_stream(server.hub, watcher, server.book, key, send_clients=clients)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)   # limits.py: 413 / 408
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app
