"""The routes vLLM's server has beside the OpenAI API, in vLLM's shapes.

    POST /tokenize            text (or chat messages) -> token ids, their count, the context length;
                              nanoserve adds `cached_tokens`: how many leading tokens the prefix cache
                              holds right now, so a request with this prompt would skip their prefill
    POST /detokenize          token ids -> text
    GET  /tokenizer_info      the tokenizer's special tokens, chat template and class
    GET  /version             nanoserve's version
    POST /reset_prefix_cache  evict every cached block nobody is using (cold and warm experiments)

Evaluation harnesses use the first three instead of loading a tokenizer of
their own (lm-evaluation-harness does when /tokenizer_info and /tokenize
answer), which matters offline: the server's tokenizer is the model's. With
an API key these routes need it like every other (the middleware in app.py).

Tokenizing runs on the tokenizer threads that count the completions' prompts
(`EngineLoop.tokenize`), never on the engine thread: a huge text holds no step
up. Then `cached_tokens` is read on the engine thread (`EngineLoop.call`),
between two steps, from the radix tree while nothing changes it
(`cached_prefix_len` changes nothing either: no split, no LRU touch). Text
that is not valid Unicode is a 400 naming its field, as on the OpenAI routes.
The request bodies live here rather than in `protocol.py`: they are vLLM's,
not OpenAI's.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

import nanoserve
from nanoserve.serve.protocol import ApiError, ChatMessage, ChatTemplateOptions, unicode_only

router = APIRouter()


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: `prompt` (text) or `messages` (through the chat template), as vLLM takes them."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None     # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        return unicode_only(data)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def _tokenizer(server, param: str):
    if server.tokenizer is None:
        raise ApiError(400, f"model {server.model_name!r} has no tokenizer: it takes token ids only", param)
    return server.tokenizer


def _check_model(server, model: str | None) -> None:
    if model is not None and model != server.model_name:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{server.model_name}`",
                       "model", "model_not_found")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    server = request.app.state.server
    _check_model(server, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send either prompt (text) or messages (a chat)", "prompt")
    tokenizer = _tokenizer(server, "prompt")
    if body.messages is not None:
        if body.add_generation_prompt and body.continue_final_message:
            raise ApiError(400, "continue_final_message=true needs add_generation_prompt=false",
                           "continue_final_message")
        dialog = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        text = server.chat_prompt(dialog, ChatTemplateOptions(
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs))
        special = bool(body.add_special_tokens)             # the template wrote its special tokens already
    else:
        text, special = body.prompt, body.add_special_tokens is not False

    ids = await asyncio.wrap_future(server.engine_loop.tokenize(tokenizer, text, add_special_tokens=special))

    def cached_tokens(engine) -> int | None:
        if engine.radix is None:                             # prefix caching is off
            return 0
        if not hasattr(engine.radix, "cached_prefix_len"):   # a lab's radix cache need not have it
            return None
        return engine.radix.cached_prefix_len(ids)

    cached = await asyncio.wrap_future(server.engine_loop.call(cached_tokens))
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
            "cached_tokens": cached}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    server = request.app.state.server
    _check_model(server, body.model)
    tokenizer = _tokenizer(server, "tokens")
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    server = request.app.state.server
    tokenizer = server.tokenizer
    if tokenizer is None:
        raise ApiError(404, f"model {server.model_name!r} has no tokenizer")
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": server.max_model_len,
            "vocab_size": len(tokenizer)}


@router.get("/version")
async def version() -> dict:
    return {"version": nanoserve.__version__}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    """Evict every cached block no running request holds (between two steps)."""
    server = request.app.state.server
    freed = await asyncio.wrap_future(server.engine_loop.call(lambda engine: engine.clear_prefix_cache()))
    return {"freed_blocks": freed}
