"""The OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions.

A request's way through the server:

    handler (asyncio)                                     engine thread
    validate the body (protocol.py) -> 400
    model name -> 404; chat: apply the chat template
    EngineLoop.submit -----------------------------------> admit: 429 if the waiting queue is full,
                                                           400 if the prompt does not fit, else add_request
    stream: return an SSE response now; whole: wait       engine.step() ... RequestOutput per step
    chunks from each output's text delta  <--------------- Sink.put(output)
    client gone (Starlette cancels the stream, or the
    body's disconnect message) -> EngineLoop.abort ------> engine.abort_request (blocks freed/cached)

Response ids double as engine request ids (`cmpl-7`, `chatcmpl-8`): what the
client sees is what the TUI and the trace show.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanoserve.errors import FieldError
from nanoserve.outputs import RequestOutput
from nanoserve.serve.engine_loop import Sink, Submission
from nanoserve.serve.protocol import ApiError, ChatRequest, CompletionRequest
from nanoserve.serve.responses import ChunkWriter, chat_body, completion_body, sse

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    server = request.app.state.server
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.started,
                                        "owned_by": "nanoserve", "max_model_len": server.max_model_len}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    body.check_supported()
    params = {**body.sampling_fields(), "max_tokens": body.max_tokens, "logprobs": body.logprobs}
    return await _generate(request, body, body.prompt, params, chat=False, top_logprobs=body.logprobs or 0)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    body.check_supported()
    server = request.app.state.server
    _check_model(server, body.model)
    prompt = server.chat_prompt(body.dialog())
    params = {**body.sampling_fields(), "max_tokens": body.requested_max_tokens, "logprobs": body.num_logprobs}
    return await _generate(request, body, prompt, params, chat=True, top_logprobs=body.top_logprobs or 0)


def _check_model(server, model: str) -> None:
    if model != server.model_name:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{server.model_name}`",
                       "model", "model_not_found")


async def _generate(request: Request, body, prompt, params: dict, chat: bool, top_logprobs: int):
    server = request.app.state.server
    _check_model(server, body.model)
    try:                                             # structured output (structured.py): checked before queueing
        params["structured_outputs"] = body.structured_outputs_params()
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    rid = server.next_request_id(chat)
    client = f"{request.client.host}:{request.client.port}" if request.client else "?"
    server.book.open(rid, client, body.user, "chat" if chat else "completions", body.stream)
    sink = Sink(asyncio.get_running_loop())
    try:
        await asyncio.wrap_future(server.engine_loop.submit(Submission(rid, prompt, params, sink)))
    except ApiError as exc:
        server.book.close(rid, "rejected" if exc.status == 429 else "error", exc.message)
        raise
    writer = ChunkWriter(rid, server.model_name, chat, server.tokenizer, top_logprobs)
    if body.stream:
        return StreamingResponse(_stream(server, rid, sink, writer, body.n, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = await _collect(request, server, rid, sink)
    if out is None:                                  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    make = chat_body if chat else completion_body
    args = (top_logprobs,) if chat else ()
    return make(out, rid, server.model_name, writer.created, server.tokenizer, *args)


async def _stream(server, rid: str, sink: Sink, writer: ChunkWriter, n: int, include_usage: bool):
    """The SSE body: chunks as tokens come, [DONE] at the end; a cancelled stream aborts the request."""
    state, detail = "disconnected", ""
    try:
        for chunk in writer.first(n):
            yield chunk
        while True:
            try:
                out = await sink.get()
            except ApiError as exc:                  # the engine gave up on it: say so in the stream
                state, detail = "error", exc.message
                yield sse(exc.body())
                break
            for chunk in writer.update(out):
                yield chunk
            server.book.update(rid, state="running", tokens=_tokens(out))
            if out.finished:
                state = "done"
                if include_usage:
                    yield writer.usage_chunk(out)
                break
        yield sse("[DONE]")
    finally:                                          # also on cancellation: the client hung up
        if state == "disconnected":
            server.engine_loop.abort(rid)
        server.book.close(rid, state, detail)


async def _collect(request: Request, server, rid: str, sink: Sink) -> RequestOutput | None:
    """Wait for the finished output; None (and the request aborted) if the client disconnects first."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(sink.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                server.engine_loop.abort(rid)
                server.book.close(rid, "disconnected")
                return None
            try:
                out = get.result()
            except ApiError as exc:
                server.book.close(rid, "error", exc.message)
                raise
            server.book.update(rid, state="running", tokens=_tokens(out))
            if out.finished:
                server.book.close(rid, "done")
                return out
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)


def _tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)
