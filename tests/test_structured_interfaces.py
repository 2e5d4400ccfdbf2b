"""Structured output from the outside: `nanoserve generate`'s flags and `nanoserve serve`'s request fields
(OpenAI's response_format, vLLM's structured_outputs and guided_*), the openai SDK's
`chat.completions.parse` returning a parsed object, and bad input as one line (exit 2) or a 400."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field
from serve_helpers import client, running_server, save_chat_model

from nanoserve.cli import main
from nanoserve.models.loader import load_model


def test_generate_flags(capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    assert main(["generate", "--max-tokens", "30", "--regex", "[0-9]{3}-[0-9]{2}", "Hi"]) == 0
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}\n", capsys.readouterr().out)
    assert main(["generate", "--max-tokens", "30", "--choice", "red,green,blue", "--temperature", "1", "--seed", "4",
                 "Hi", "Yo"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] in ("red", "green", "blue") and printed[3] in ("red", "green", "blue")
    assert main(["generate", "--max-tokens", "30", "--json-schema", str(schema), "Hi"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] in (True, False)


@pytest.mark.parametrize("argv, line", [
    (["--regex", "(a"], "nanoserve: error: --regex is not a valid regular expression: "),
    (["--json-schema", "/no/such.json"], "nanoserve: error: --json-schema /no/such.json: no such file"),
    (["--choice", "a,,b"], "nanoserve: error: --choice must hold only non-empty strings"),
    (["--regex", "a", "--choice", "b"], "nanoserve: error: give one of --json-schema, --regex"),
])
def test_generate_bad_flags_are_one_line(capsys, argv, line):
    assert main(["generate", *argv, "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1


# -- the server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    loaded = load_model(save_chat_model(tmp_path_factory.mktemp("chat-llama")))
    with running_server(loaded) as (url, srv):
        yield url, srv


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    confident: bool
    score: int = Field(ge=0, le=9)


def test_openai_sdk_parse_returns_a_parsed_object(served):
    url, srv = served
    for seed in range(3):
        completion = client(url).chat.completions.parse(
            model=srv.model_name, messages=[{"role": "user", "content": "Is the sky blue?"}],
            response_format=Verdict, temperature=1.0, seed=seed, max_tokens=60)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Verdict) and completion.choices[0].finish_reason == "stop"


# The served model has random weights: whether it closes a JSON object within max_tokens is up to the draw.
# Every body below ends with "stop" under this seed (the sampler's draws are fixed by it).
SEED = 4

BODIES = {
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "strict": True, "schema": {"type": "object", "properties": {"n": {"type": "integer",
                                                "minimum": 0, "maximum": 99}}, "required": ["n"]}}}},
                    lambda t: set(json.loads(t)) == {"n"}),
    "structured_outputs": ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    "guided_regex": ({"guided_regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t)),
    "guided_choice": ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    "guided_json": ({"guided_json": {"type": "object", "properties": {"b": {"type": "boolean"}},
                                     "required": ["b"]}}, lambda t: isinstance(json.loads(t)["b"], bool)),
    "guided_grammar": ({"guided_grammar": 'root ::= "x" [0-9] "y"'}, lambda t: re.fullmatch("x[0-9]y", t)),
}


@pytest.mark.parametrize("name", list(BODIES))
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_way_of_asking_is_honoured(served, name, endpoint):
    url, srv = served
    extra, ok = BODIES[name]
    body = {"model": srv.model_name, "max_tokens": 80, "temperature": 0.9, "seed": SEED, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Go"}]
    else:
        body["prompt"] = "Go"
    r = httpx.post(f"{url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert choice["finish_reason"] == "stop" and ok(text), text


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_structured_requests_are_a_400_naming_the_field(served, extra, param):
    url, srv = served
    before = srv.engine_loop.call(lambda e: e.step_count).result(10)
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": srv.model_name, "max_tokens": 5,
                                                       "messages": [{"role": "user", "content": "Go"}], **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "\n" not in r.json()["error"]["message"]
    assert srv.engine_loop.call(lambda e: (e.step_count, len(e.requests))).result(10) == (before, 0)
