"""Fields a client may send that `nanoserve serve` cannot honour: refused with a 400, never ignored.

A field that is silently ignored is worse than an error: a client asking for
JSON (`response_format`) and getting free text fails later, somewhere else,
for a reason it cannot see. So the request bodies (`protocol.py`) keep the
fields they do not declare (`extra="allow"`), and every one named in
`REFUSED` that is set to something other than its "off" value is refused with
a 400 that names it and says why. Fields in neither place are ignored, as
OpenAI's server ignores what it does not know.

The table holds OpenAI's fields that need a mechanism nanoserve does not have
(function calling) and vLLM's extensions that change what is generated.
`protocol.py` owns the fields nanoserve honours (structured output's
`response_format`, `structured_outputs` and `guided_*` among them:
structured.py); this module only says no.
"""

from __future__ import annotations

REFUSED = {   # field -> why not
    "guided_decoding_backend": "structured output always runs on xgrammar (structured_output.py)",
    "guided_whitespace_pattern": "structured output's JSON is one line with no free whitespace",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "tool_choice": "function calling is not supported (tools are refused too)",
    "parallel_tool_calls": "function calling is not supported (tools are refused too)",
    "audio": "audio output is not supported: the models generate text",
    "modalities": "only text is generated",
    "prediction": "predicted outputs are not supported (speculative decoding is a server flag: --speculative)",
    "reasoning_effort": "the models have no reasoning effort setting",
    "verbosity": "the models have no verbosity setting",
    "web_search_options": "web search is not supported",
    "store": "completions are not stored",
    "length_penalty": "beam search runs offline (SamplingParams(beam_width=...)), not over HTTP",
    "early_stopping": "beam search runs offline (SamplingParams(beam_width=...)), not over HTTP",
    "priority": "requests are served first come, first served over HTTP",
    "use_beam_search": "beam search runs offline (SamplingParams(beam_width=...)), not over HTTP",
    "allowed_token_ids": "restricting the vocabulary is not supported",
    "bad_words": "banning words is not supported",
    "logits_processors": "custom logits processors are not supported",
    "truncate_prompt_tokens": "prompts are never truncated: a prompt that does not fit is a 400",
    "prompt_embeds": "prompts are text or token ids, not embeddings",
    "return_tokens_as_token_ids": "tokens are returned as text",
    "chat_template": "the server uses the model's own chat template (chat_template_kwargs sets its variables)",
}


OFF = {   # field -> values that also mean "not used", besides null, false and empty
    "tool_choice": ("none",),
    "modalities": (["text"],),
    "priority": (0,),
}


def is_off(name: str, value) -> bool:
    """The value a client sends to mean "not used" (null, false, empty, or the field's OFF values)."""
    return value is None or value is False or value == [] or value == {} or value == "" \
        or any(value == off and type(value) is type(off) for off in OFF.get(name, ()))


def unsupported_field(extra: dict) -> tuple[str, str] | None:
    """(field, message) for the first field of `extra` (a body's undeclared fields) that nanoserve refuses."""
    for name, value in extra.items():
        if name in REFUSED and not is_off(name, value):
            return name, f"{name} is not supported by nanoserve: {REFUSED[name]}"
    return None
