"""The OpenAI routes: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions.

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
client sees is what the TUI and the trace show. A completions request with a
batch of prompts runs one engine request per prompt (`cmpl-7-0`, `cmpl-7-1`,
...), all admitted in the same pass of the engine loop, all or none (a prompt
that does not fit aborts the rest of its batch), answered together.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanoserve.errors import FieldError
from nanoserve.outputs import RequestOutput
from nanoserve.serve.engine_loop import Sink, Submission
from nanoserve.serve.protocol import ApiError, ChatRequest, CompletionRequest
from nanoserve.serve.responses import ChunkWriter, Shape, chat_body, completion_body, prompt_text, sse
from nanoserve.validation import token_ids

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request.app.state.server)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """One model (`client.models.retrieve`): the served one, or 404."""
    server = request.app.state.server
    _check_model(server, model_id)
    return _model_card(server)


def _model_card(server) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.started, "owned_by": "nanoserve",
            "max_model_len": server.max_model_len}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    body.check_supported()
    server = request.app.state.server
    prompts = body.prompts()
    # echo with logprobs needs the prompt's log-probabilities; max_tokens=0 (echo only) still samples one
    # token, which the answer leaves out (as vLLM does)
    k = max(body.prompt_logprobs or 0, body.logprobs or 0) \
        if body.prompt_logprobs is not None or (body.echo and body.logprobs is not None) else None
    params = {**body.sampling_fields(), "max_tokens": 1 if body.echo_only else body.max_tokens,
              "logprobs": body.logprobs, "prompt_logprobs": k}
    echo = [prompt_text(server.tokenizer, _known_ids(server, p, i, len(prompts))) for i, p in enumerate(prompts)] \
        if body.echo else None
    shape = Shape(n=body.n, logprobs=body.logprobs, echo=echo, echo_only=body.echo_only,
                  prompt_logprobs=body.prompt_logprobs)
    return await _generate(request, body, prompts, params, chat=False, shape=shape)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    body.check_supported()
    server = request.app.state.server
    _check_model(server, body.model)
    prompt = server.chat_prompt(body.dialog(), body.template_options())
    params = {**body.sampling_fields(), "max_tokens": body.requested_max_tokens, "logprobs": body.num_logprobs}
    shape = Shape(top_logprobs=body.top_logprobs or 0, echo=[body.echo_text], prompt_logprobs=body.prompt_logprobs)
    return await _generate(request, body, [prompt], params, chat=True, shape=shape)


def _known_ids(server, prompt: str | list[int], i: int, num_prompts: int) -> str | list[int]:
    """A prompt of token ids echoed back is decoded here, before the engine checks it: so check its
    ids first (an id past the vocabulary made the tokenizer raise: a 500)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return token_ids("prompt" if num_prompts == 1 else f"prompt.{i}", prompt, server.engine_loop.engine.vocab_size)
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.field) from None


def _check_model(server, model: str) -> None:
    if model != server.model_name:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{server.model_name}`",
                       "model", "model_not_found")


async def _generate(request: Request, body, prompts: list, params: dict, chat: bool, shape: Shape):
    """Submit each prompt as its own engine request (`<id>-<i>` in a batch), then answer them together."""
    server = request.app.state.server
    _check_model(server, body.model)
    try:                                             # structured output (structured.py): checked before queueing
        params["structured_outputs"] = spec = body.structured_outputs_params()
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    field = body.constraint_field()
    if spec is not None:                             # compiled off the engine thread, bounded (grammars.py)
        await server.grammars.check(spec, field, params)
    rid = server.next_request_id(chat)
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    client = f"{request.client.host}:{request.client.port}" if request.client else "?"
    server.book.open(rid, client, body.user, "chat" if chat else "completions", body.stream)
    sink = Sink(asyncio.get_running_loop(), field)   # one for the whole batch: outputs carry their request id
    futures = [server.engine_loop.submit(Submission(i, p, params, sink)) for i, p in zip(ids, prompts)]
    results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
    refused = next((r for r in results if isinstance(r, BaseException)), None)
    if refused is not None:                       # all or nothing: the admitted ones of the batch go too
        for i, r in zip(ids, results):
            if not isinstance(r, BaseException):
                server.engine_loop.abort(i)
        server.book.close(rid, "rejected" if getattr(refused, "status", None) == 429 else "error", str(refused))
        if len(prompts) > 1 and isinstance(refused, ApiError):
            which = next(n for n, r in enumerate(results) if r is refused)
            refused.message = f"prompt {which} of the batch: {refused.message}"
        raise refused
    writer = ChunkWriter(rid, server.model_name, chat, server.tokenizer, shape)
    if body.stream:
        return StreamingResponse(_stream(server, rid, ids, sink, writer, body.n, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await _collect(request, server, rid, ids, sink)
    if outs is None:                                 # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    if chat:
        return chat_body(outs[0], rid, server.model_name, writer.created, server.tokenizer, shape)
    return completion_body(outs, rid, server.model_name, writer.created, server.tokenizer, shape)


async def _stream(server, rid: str, ids: list[str], sink: Sink, writer: ChunkWriter, n: int, include_usage: bool):
    """The SSE body: chunks as tokens come, [DONE] at the end; a cancelled stream aborts the requests."""
    state, detail = "disconnected", ""
    index = {i: k for k, i in enumerate(ids)}        # engine request id -> prompt index
    latest: dict[str, RequestOutput] = {}
    try:
        for chunk in writer.first(n):
            yield chunk
        while len(latest) < len(ids) or not all(out.finished for out in latest.values()):
            try:
                out = await sink.get()
            except ApiError as exc:                  # the engine gave up on it: say so in the stream
                state, detail = "error", exc.message
                yield sse(exc.body())
                break
            latest[out.request_id] = out
            for chunk in writer.update(out, index[out.request_id]):
                yield chunk
            server.book.update(rid, state="running", tokens=_tokens(latest.values()))
        else:
            state = "done"
            if include_usage:
                yield writer.usage_chunk([latest[i] for i in ids])
        yield sse("[DONE]")
    finally:                                          # also on cancellation: the client hung up
        if state != "done":
            for i in ids:
                if i not in latest or not latest[i].finished:
                    server.engine_loop.abort(i)
        server.book.close(rid, state, detail)


async def _collect(request: Request, server, rid: str, ids: list[str], sink: Sink) -> list[RequestOutput] | None:
    """Wait for every prompt's finished output (in prompt order); None (and the requests aborted) if the
    client disconnects first."""
    gone = asyncio.ensure_future(_disconnected(request))
    latest: dict[str, RequestOutput] = {}
    try:
        while len(latest) < len(ids) or not all(out.finished for out in latest.values()):
            get = asyncio.ensure_future(sink.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                _abort_unfinished(server, ids, latest)
                server.book.close(rid, "disconnected")
                return None
            try:
                out = get.result()
            except ApiError as exc:
                _abort_unfinished(server, ids, latest)
                server.book.close(rid, "error", exc.message)
                raise
            latest[out.request_id] = out
            server.book.update(rid, state="running", tokens=_tokens(latest.values()))
        server.book.close(rid, "done")
        return [latest[i] for i in ids]
    finally:
        gone.cancel()


def _abort_unfinished(server, ids: list[str], latest: dict[str, RequestOutput]) -> None:
    for i in ids:
        if i not in latest or not latest[i].finished:
            server.engine_loop.abort(i)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)


def _tokens(outs) -> int:
    return sum(len(c.token_ids) for out in outs for c in out.outputs)
