"""What clients get back: engine outputs as OpenAI JSON, whole or as stream chunks.

This module owns the response side of the OpenAI API: a finished
`RequestOutput` becomes a `text_completion` or `chat.completion` object, and
while a request runs, each step's new text (the detokenizer's `delta` for
every completion) becomes a `chunk` for server-sent events. It keeps no
connection state beyond `ChunkWriter`, which remembers, per completion, how
many tokens it has already sent (for their log-probabilities) and whether
the finish reason went out.

finish_reason is the engine's ("stop": EOS, a stop string or stop token;
"length": max_tokens or the context). An engine-side failure ("abort" with
an error) is not a completion: the route answers it as an error.
"""

from __future__ import annotations

import json
import time

from nanoserve.outputs import CompletionOutput, RequestOutput


def usage(out: RequestOutput) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(tokenizer, token_id: int) -> str:
    """One token as text (its bytes may be half a character: then the replacement character shows)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer, c: CompletionOutput, start: int, text_offset: int) -> dict | None:
    """The legacy completions `logprobs` object for tokens start.. of one completion."""
    if c.logprobs is None:
        return None
    ids, lps = c.token_ids[start:], c.logprobs[start:]
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets, at = [], text_offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.get(t) for t, lp in zip(ids, lps)],
        "top_logprobs": [{token_text(tokenizer, k): v for k, v in lp.items()} for lp in lps],
        "text_offset": offsets,
    }


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


def completion_body(out: RequestOutput, rid: str, model: str, created: int, tokenizer) -> dict:
    choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": completion_logprobs(tokenizer, c, 0, 0)} for c in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(out)}


def chat_body(out: RequestOutput, rid: str, model: str, created: int, tokenizer, top_logprobs: int) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "logprobs": chat_logprobs(tokenizer, c, 0, top_logprobs)}
               for c in out.outputs]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(out)}


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ChunkWriter:
    """Turns each step's RequestOutput of one request into SSE chunks (completions or chat)."""

    def __init__(self, rid: str, model: str, chat: bool, tokenizer, top_logprobs: int = 0) -> None:
        self.rid, self.model, self.chat, self.tokenizer = rid, model, chat, tokenizer
        self.top_logprobs = top_logprobs
        self.created = int(time.time())
        self.sent_tokens: dict[int, int] = {}      # completion index -> tokens already sent
        self.sent_chars: dict[int, int] = {}       # completion index -> text length already sent
        self.finished: set[int] = set()            # completion indexes whose finish_reason went out

    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                    "choices": choices, **extra})

    def first(self, n: int) -> list[str]:
        """Chat streams open each choice with the assistant's role."""
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(n)]

    def update(self, out: RequestOutput) -> list[str]:
        """Chunks for what this output adds: new text (and log-probabilities), finish reasons."""
        chunks = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            start = self.sent_tokens.get(c.index, 0)
            new_tokens = len(c.token_ids) - start
            if not c.delta and not c.finished and not (new_tokens and c.logprobs is not None):
                continue   # tokens that are not text yet (half a UTF-8 character) wait for the next step
            if self.chat:
                lp = chat_logprobs(self.tokenizer, c, start, self.top_logprobs)
                choice = {"index": c.index, "delta": {"content": c.delta} if c.delta else {}, "logprobs": lp}
            else:
                lp = completion_logprobs(self.tokenizer, c, start, self.sent_chars.get(c.index, 0))
                choice = {"index": c.index, "text": c.delta, "logprobs": lp}
            choice["finish_reason"] = c.finish_reason
            self.sent_tokens[c.index] = len(c.token_ids)
            self.sent_chars[c.index] = self.sent_chars.get(c.index, 0) + len(c.delta)
            if c.finished:
                self.finished.add(c.index)
            chunks.append(self._chunk([choice]))
        return chunks

    def usage_chunk(self, out: RequestOutput) -> str:
        """stream_options.include_usage: the last chunk, with no choices."""
        return self._chunk([], usage=usage(out))
