"""What clients get back: engine outputs as OpenAI JSON, whole or as stream chunks.

This module owns the response side of the OpenAI API: finished
`RequestOutput`s become a `text_completion` or `chat.completion` object, and
while a request runs, each step's new text (the detokenizer's `delta` for
every completion) becomes a `chunk` for server-sent events. It keeps no
connection state beyond `ChunkWriter`, which remembers, per choice, how many
tokens it has already sent (for their log-probabilities), whether the echo
and the finish reason went out.

A completions request may hold a batch of prompts, each its own engine
request: prompt i's completion j is choice `i * n + j` (`Shape.n`), as in
OpenAI's and vLLM's servers, and `usage` adds them up.

The prompt can come back too (`Shape`): `echo` puts each prompt's text before
its completions and, with `logprobs`, its tokens before theirs, the first one
with `null` log-probabilities (it has no context); with `max_tokens=0` only
the prompt comes back (the engine generates one token, which is dropped, as
vLLM does). vLLM's `prompt_logprobs` comes as its own field, in vLLM's shape
(`{token id: {logprob, rank, decoded_token}}` per prompt token). Chat's echo
(vLLM) puts the last message's text before the reply when that message is
the assistant's.

finish_reason is the engine's ("stop": EOS, a stop string or stop token;
"length": max_tokens or the context). An engine-side failure ("abort" with
an error) is not a completion: the route answers it as an error.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from nanoserve.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class Shape:
    """How one HTTP request's answer is shaped, beyond the engine's outputs."""

    n: int = 1                        # completions per prompt: prompt i's completion j is choice i * n + j
    logprobs: int | None = None       # completions: top log-probabilities per token (None: no logprobs object)
    top_logprobs: int = 0             # chat: alternatives per token
    echo: list[str] | None = None     # completions: each prompt's text, before its completions; chat: [last text]
    echo_only: bool = False           # echo with max_tokens=0: the generated token is not shown
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs field: the top k per prompt token


def usage(outs: list[RequestOutput], echo_only: bool = False) -> dict:
    completion = 0 if echo_only else sum(len(c.token_ids) for out in outs for c in out.outputs)
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(tokenizer, token_id: int) -> str:
    """One token as text (its bytes may be half a character: then the replacement character shows)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def prompt_text(tokenizer, prompt: str | list[int]) -> str:
    """A prompt as text (token ids decoded; "" without a tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else ""


def _legacy(tokenizer, token_ids: list[int], entries: list[dict[int, float] | None], k: int,
            text_offset: int) -> dict:
    """The legacy completions `logprobs` object: per token its text, log-probability, top k and text offset."""
    tokens, chosen, tops, offsets, at = [], [], [], [], text_offset
    for t, lp in zip(token_ids, entries):
        text = token_text(tokenizer, t)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        if lp is None:                     # the first prompt token: no context, no log-probability
            chosen.append(None)
            tops.append(None)
            continue
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:k]   # (an entry may hold more than k + the token)
        chosen.append(lp.get(t))
        tops.append({token_text(tokenizer, i): v for i, v in [*best, (t, lp[t])]})
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def _end_offset(obj: dict) -> int:
    return obj["text_offset"][-1] + len(obj["tokens"][-1]) if obj["tokens"] else 0


def _join(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def completion_logprobs(tokenizer, c: CompletionOutput, start: int, text_offset: int, k: int) -> dict | None:
    """The legacy completions `logprobs` object for tokens start.. of one completion."""
    if c.logprobs is None:
        return None
    return _legacy(tokenizer, c.token_ids[start:], c.logprobs[start:], k, text_offset)


def echo_logprobs(tokenizer, out: RequestOutput, k: int) -> dict:
    """The same object for the prompt's tokens (echo with logprobs), from the engine's prompt log-probs."""
    return _legacy(tokenizer, out.prompt_token_ids, out.prompt_logprobs, k, 0)


def vllm_prompt_logprobs(tokenizer, out: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the k most likely tokens and the prompt's own. rank: 1 = most likely; null for the prompt's token
    when it is not among the k (the engine does not rank the whole vocabulary)."""
    shaped: list[dict | None] = []
    for t, lp in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        if lp is None:
            shaped.append(None)
            continue
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])
        best = {i for i, _ in ranked[:k]}
        shaped.append({i: {"logprob": v, "rank": r + 1 if i in best else None, "decoded_token": token_text(tokenizer, i)}
                       for r, (i, v) in enumerate(ranked) if i in best or i == t})
    return shaped


def chat_logprobs(tokenizer, c: CompletionOutput, start: int, top: int) -> dict | None:
    """The chat `logprobs` object ({"content": [...]}) for tokens start.. of one completion."""
    if c.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for t, lp in zip(c.token_ids[start:], c.logprobs[start:]):
        alternatives = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(t, lp.get(t, float("-inf"))), "top_logprobs": [entry(k, v) for k, v in alternatives]})
    return {"content": content}


def _completion_choice(tokenizer, out: RequestOutput, c: CompletionOutput, i: int, shape: Shape) -> dict:
    echo = shape.echo[i] if shape.echo is not None else ""
    text = echo + ("" if shape.echo_only else c.text)
    logprobs = None
    if shape.logprobs is not None:
        logprobs = echo_logprobs(tokenizer, out, shape.logprobs) if shape.echo is not None else None
        generated = None if shape.echo_only else \
            completion_logprobs(tokenizer, c, 0, _end_offset(logprobs) if logprobs else 0, shape.logprobs)
        logprobs = _join(logprobs, generated) if logprobs and generated else logprobs or generated
    choice = {"index": i * shape.n + c.index, "text": text,
              "finish_reason": "length" if shape.echo_only else c.finish_reason, "logprobs": logprobs}
    if shape.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out, shape.prompt_logprobs)
    return choice


def completion_body(outs: list[RequestOutput], rid: str, model: str, created: int, tokenizer,
                    shape: Shape) -> dict:
    """The `text_completion` object for the finished outputs of a request's prompts, in prompt order."""
    choices = [_completion_choice(tokenizer, out, c, i, shape) for i, out in enumerate(outs) for c in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda ch: ch["index"]), "usage": usage(outs, shape.echo_only)}


def chat_body(out: RequestOutput, rid: str, model: str, created: int, tokenizer, shape: Shape) -> dict:
    echo = shape.echo[0] if shape.echo else ""
    choices = [{"index": c.index, "message": {"role": "assistant", "content": echo + c.text},
                "finish_reason": c.finish_reason, "logprobs": chat_logprobs(tokenizer, c, 0, shape.top_logprobs)}
               for c in out.outputs]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage([out])}
    if shape.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out, shape.prompt_logprobs)
    return body


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ChunkWriter:
    """Turns each step's RequestOutputs of one HTTP request into SSE chunks (completions or chat)."""

    def __init__(self, rid: str, model: str, chat: bool, tokenizer, shape: Shape | None = None) -> None:
        self.rid, self.model, self.chat, self.tokenizer = rid, model, chat, tokenizer
        self.shape = shape or Shape()
        self.created = int(time.time())
        self.sent_tokens: dict[int, int] = {}      # choice index -> tokens already sent
        self.sent_chars: dict[int, int] = {}       # choice index -> text offset reached
        self.echoed: set[int] = set()              # choice indexes whose prompt went out (echo)
        self.finished: set[int] = set()            # choice indexes whose finish_reason went out

    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                    "choices": choices, **extra})

    def first(self, n: int) -> list[str]:
        """Chat streams open each choice with the assistant's role (and, with echo, the text it continues)."""
        if not self.chat:
            return []
        chunks = [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]) for i in range(n)]
        if self.shape.echo and self.shape.echo[0]:
            chunks += [self._chunk([{"index": i, "delta": {"content": self.shape.echo[0]}, "logprobs": None,
                                     "finish_reason": None}]) for i in range(n)]
        return chunks

    def update(self, out: RequestOutput, prompt_index: int = 0) -> list[str]:
        """Chunks for what this output (of the request's prompt `prompt_index`) adds: new text (and
        log-probabilities), the echoed prompt first, finish reasons."""
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.shape.n + c.index
            if index in self.finished:
                continue
            choice = self._chat_choice(c, index) if self.chat else self._completion_choice(out, c, index, prompt_index)
            if choice is None:
                continue   # tokens that are not text yet (half a UTF-8 character) wait for the next step
            if c.finished:
                self.finished.add(index)
            chunks.append(self._chunk([choice]))
        return chunks

    def _new_tokens(self, c: CompletionOutput, index: int) -> tuple[int, bool]:
        """(tokens already sent, whether this step brings something to send)."""
        start = self.sent_tokens.get(index, 0)
        return start, bool(c.delta or c.finished or (len(c.token_ids) > start and c.logprobs is not None))

    def _chat_choice(self, c: CompletionOutput, index: int) -> dict | None:
        start, news = self._new_tokens(c, index)
        if not news:
            return None
        self.sent_tokens[index] = len(c.token_ids)
        return {"index": index, "delta": {"content": c.delta} if c.delta else {},
                "logprobs": chat_logprobs(self.tokenizer, c, start, self.shape.top_logprobs),
                "finish_reason": c.finish_reason}

    def _completion_choice(self, out: RequestOutput, c: CompletionOutput, index: int, prompt_index: int) -> dict | None:
        shape = self.shape
        text, logprobs = "", None
        if shape.echo is not None and index not in self.echoed:      # the prompt, once, before anything else
            self.echoed.add(index)
            text = shape.echo[prompt_index]
            if shape.logprobs is not None:
                logprobs = echo_logprobs(self.tokenizer, out, shape.logprobs)
                self.sent_chars[index] = _end_offset(logprobs)
            else:
                self.sent_chars[index] = len(text)
        start, news = self._new_tokens(c, index)
        if shape.echo_only:                  # nothing generated is shown: the prompt, then "length"
            if not text and not c.finished:
                return None
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason and "length"}
        if not news and not text:
            return None
        if shape.logprobs is not None:
            generated = completion_logprobs(self.tokenizer, c, start, self.sent_chars.get(index, 0), shape.logprobs)
            if generated is not None:
                self.sent_chars[index] = _end_offset(generated) if generated["tokens"] else self.sent_chars.get(index, 0)
            logprobs = _join(logprobs, generated) if logprobs and generated else logprobs or generated
        else:
            self.sent_chars[index] = self.sent_chars.get(index, 0) + len(c.delta)
        self.sent_tokens[index] = len(c.token_ids)
        return {"index": index, "text": text + c.delta, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def usage_chunk(self, outs: list[RequestOutput]) -> str:
        """stream_options.include_usage: the last chunk, with no choices."""
        return self._chunk([], usage=usage(outs, self.shape.echo_only))
