"""What clients send: the OpenAI request bodies, validated, and their errors.

This module owns the request side of the OpenAI API that `nanoserve serve`
speaks: `CompletionRequest` (`POST /v1/completions`), `ChatRequest`
(`POST /v1/chat/completions`), how their fields map to `SamplingParams`, and
`ApiError`, the one exception every route turns into an OpenAI-style error
body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

The models are pydantic in strict mode, so `"max_tokens": "5"` is an error
naming the field instead of a silent conversion. Fields the OpenAI API has
and nanoserve cannot honour (`best_of`, `suffix`, `logit_bias`, tools) are
rejected with a sentence rather than ignored, and so are the fields of
`unsupported.py`'s table (`response_format` other than text, vLLM's guided
decoding, ...); other unknown fields are ignored, as the OpenAI server does.
Fields from vLLM's extended API (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `prompt_logprobs`,
`skip_special_tokens`, `include_stop_str_in_output`) map to the engine
settings of the same names; chat's `echo`, `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs` are honoured as vLLM does.

Building responses lives in `responses.py`.
"""

from __future__ import annotations

import inspect
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from nanoserve.errors import FieldError
from nanoserve.serve.structured import StructuredFields
from nanoserve.serve.unsupported import unsupported_field
from nanoserve.validation import well_formed

MAX_N = 128            # OpenAI's own upper bound on `n`; the engine's max_num_seqs is usually lower
MAX_LOGPROBS = 20      # top log-probabilities per token, as in the OpenAI API


class ApiError(Exception):
    """An error a client gets back as an OpenAI-style JSON body with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}   # other 4xx: invalid_request_error

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False        # a last chunk with `usage` and no choices


def _refuse(param: str, message: str) -> PydanticCustomError:
    """A validation error that names its field (`validation_error` turns it into a 400 with that param)."""
    return PydanticCustomError("nanoserve", "{message}", {"param": param, "message": message})


def first_bad_text(data) -> tuple[str, str] | None:
    """(field path, what is wrong) for the first string in a JSON body that is not valid Unicode
    (a lone surrogate: "\\ud800" is valid JSON), or None. Walks without recursion: depth is no risk."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                well_formed(path or "body", value)
            except FieldError as exc:
                return exc.field, exc.text
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in reversed(list(enumerate(value))))
    return None


def unicode_only(data):
    """A body's `mode="before"` check: every string of it must be valid Unicode, before anything reads
    it (the tokenizer, the chat template, the clients table, a trace): one 400 naming the field."""
    bad = first_bad_text(data)
    if bad is not None:
        raise _refuse(bad[0], f"{bad[0]} {bad[1]}")
    return data


class _Sampling(StructuredFields):
    """The fields both endpoints share; each maps to the SamplingParams field of the same meaning
    (and structured output's: response_format, vLLM's structured_outputs and guided_*: structured.py)."""

    model_config = ConfigDict(strict=True, extra="allow")   # extras: refused (unsupported.py) or ignored

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        return unicode_only(data)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "stream_options is only allowed with stream=true")
        return self

    model: str                                             # must name the served model (else 404)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)        # 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                                # shown in the TUI's clients panel
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # per prompt token (not with stream)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_fields(self) -> dict:
        """SamplingParams keyword arguments, except max_tokens and logprobs (the endpoints differ)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    stop=stop, seed=self.seed, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                    min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                    stop_token_ids=list(self.stop_token_ids or []), prompt_logprobs=self.prompt_logprobs,
                    skip_special_tokens=self.skip_special_tokens,
                    include_stop_str_in_output=self.include_stop_str_in_output)

    def check_common(self) -> None:
        """What both endpoints refuse: the fields of unsupported.py's table, prompt log-probabilities in a stream."""
        refused = unsupported_field(self.model_extra or {})
        if refused is not None:
            raise ApiError(400, refused[1], refused[0])
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs cannot be streamed (as in vLLM): use stream=false", "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: complete a prompt or a batch of prompts (text, or token ids).

    Each prompt of a batch is its own engine request; the n completions of prompt i are the choices
    i * n .. i * n + n - 1, as in OpenAI's and vLLM's servers.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)               # OpenAI's default; None: fill the context; 0: echo only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # top log-probabilities per token
    echo: bool = False                                     # the prompt (and with logprobs its tokens) first
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one, or a batch."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt (and its log-probabilities) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        self.check_common()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens=0 generates nothing: it needs echo=true (the prompt's log-probabilities "
                                "back, as vLLM does)", "max_tokens")
        if self.best_of not in (None, self.n):
            raise ApiError(400, "best_of is not supported by nanoserve (use n, or beam search offline)", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix (insertion) is not supported by nanoserve", "suffix")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by nanoserve", "logit_bias")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ApiError(400, "prompt is an empty list", "prompt")
        prompts = self.prompts()
        for i, prompt in enumerate(prompts):
            if not prompt:
                where = "prompt" if len(prompts) == 1 else f"prompt {i} of the batch"
                raise ApiError(400, f"{where} is empty", "prompt")


class ChatTemplateOptions(BaseModel):
    """How the messages become the prompt (vLLM's chat extras), passed to `apply_chat_template`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    add_generation_prompt: bool = True       # end where the assistant starts to speak
    continue_final_message: bool = False     # or: go on with the last (assistant) message, unterminated
    chat_template_kwargs: dict | None = None  # more variables for the template (e.g. enable_thinking)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    """`POST /v1/chat/completions`: the messages go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)             # None: up to the model's context
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name for the same thing
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict | None = None
    tools: list | None = None
    echo: bool = False                       # vLLM: the last message's text first, if it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def check_supported(self) -> None:
        self.check_common()
        if self.add_generation_prompt and self.continue_final_message:
            raise ApiError(400, "continue_final_message=true continues the last message: it needs "
                                "add_generation_prompt=false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ApiError(400, "continue_final_message=true needs the last message to be the assistant's",
                           "continue_final_message")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by nanoserve", "logit_bias")
        if self.tools:
            raise ApiError(400, "tools (function calling) are not supported by nanoserve", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off), or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def dialog(self) -> list[dict]:
        """The messages as the chat template takes them (`developer` is the newer name for `system`)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def template_options(self) -> ChatTemplateOptions:
        return ChatTemplateOptions(add_generation_prompt=self.add_generation_prompt,
                                   continue_final_message=self.continue_final_message,
                                   chat_template_kwargs=self.chat_template_kwargs)

    @property
    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's text when it is the assistant's (the reply continues it)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


def template_variables(tokenizer, kwargs: dict | None) -> dict:
    """chat_template_kwargs as variables for the template. A name that `apply_chat_template` takes itself
    (`tokenize`, `chat_template`, `tools`, ...) is refused: it would change what the server does rather
    than what the template says."""
    if not kwargs:
        return {}
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"self", "kwargs"}
    for name in kwargs:
        if name in own:
            raise ApiError(400, f"chat_template_kwargs.{name} is an argument of apply_chat_template, not a "
                                "template variable (add_generation_prompt and continue_final_message are fields "
                                "of the request)", f"chat_template_kwargs.{name}")
    return dict(kwargs)


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 for pydantic/FastAPI validation errors: the first one, naming its field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if first.get("type") == "nanoserve":                   # our own checks (_refuse): the message names the field
        return ApiError(400, first["ctx"]["message"], first["ctx"]["param"])
    if not loc:                                            # about the body as a whole
        if first.get("type") == "missing":
            return ApiError(400, "the request has no body: send a JSON object with the request's fields")
        return ApiError(400, f"the request body must be a JSON object with the request's fields ({first['msg']})")
    # union members show up in the location ("prompt.str"); keep the field path only
    loc = [x for x in loc if x not in ("str", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]",
                                       "StreamOptions", "int", "float", "bool", "dict", "list")]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        return ApiError(400, f"{param} is required", param)
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 60 else type(got).__name__
    return ApiError(400, f"{param}: {first['msg']} (got {shown})" if param else first["msg"], param)
