"""Bad input keeps the server up and gets an OpenAI-style error with the right status: malformed JSON,
missing or wrong-typed fields, negative or huge max_tokens, a prompt longer than the context, an unknown
model (404), n above the limit, a wrong API key (401), a full queue (429)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import check_clean, client, on_engine, running_server, wait_idle

from nanoserve.models.loader import load_model
from nanoserve.serve.command import is_loopback

KEY = "s3cret"
CONTEXT = 128       # max_model_len of these servers: a long prompt is easy to make


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def server(loaded):
    config = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=CONTEXT)
    with running_server(loaded, config, max_waiting=2) as (url, srv):
        yield url, srv


def post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def ok(model: str, **fields) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}


BAD_COMPLETIONS = [
    # (body, param, words in the message)
    (lambda m: {"prompt": "Hello"}, "model", ["required"]),
    (lambda m: {"model": m}, "prompt", ["required"]),
    (lambda m: ok(m, max_tokens="5"), "max_tokens", ["integer"]),
    (lambda m: ok(m, max_tokens=-1), "max_tokens", ["greater than or equal to 0"]),
    (lambda m: ok(m, max_tokens=0), "max_tokens", ["echo"]),                # 0 only with echo
    (lambda m: ok(m, max_tokens=10**12), "max_tokens", ["maximum context length is 128"]),
    (lambda m: ok(m, prompt="x" * 500), "prompt", ["maximum context length is 128", "500"]),
    (lambda m: ok(m, prompt=[1, 2, 999999]), "prompt", ["outside the vocabulary"]),
    (lambda m: ok(m, prompt=42), "prompt", []),
    (lambda m: ok(m, prompt=["a", 1]), "prompt", []),                     # a batch of one kind
    (lambda m: ok(m, prompt=[[1, 2], "b"]), "prompt", []),
    (lambda m: ok(m, prompt=[[1, "b"]]), "prompt", []),
    (lambda m: ok(m, prompt=""), "prompt", ["empty"]),
    (lambda m: ok(m, prompt=[]), "prompt", ["empty"]),
    (lambda m: ok(m, prompt=["a", ""]), "prompt", ["prompt 1 of the batch is empty"]),
    (lambda m: ok(m, prompt=[[1, 2], []]), "prompt", ["prompt 1 of the batch is empty"]),
    (lambda m: ok(m, prompt=["a", "x" * 500]), "prompt", ["prompt 1 of the batch", "maximum context length"]),
    (lambda m: ok(m, temperature="hot"), "temperature", ["number"]),
    (lambda m: ok(m, temperature=-1), "temperature", []),
    (lambda m: ok(m, top_p=0), "top_p", []),
    (lambda m: ok(m, n=5), "n", ["max_num_seqs=4"]),          # above the engine's seats
    (lambda m: ok(m, n=1000), "n", []),                       # above the API's limit
    (lambda m: ok(m, n=0), "n", []),
    (lambda m: ok(m, stream="yes"), "stream", []),
    (lambda m: ok(m, stop=[""]), "stop", ["non-empty"]),
    (lambda m: ok(m, logprobs=99), "logprobs", []),
    (lambda m: ok(m, echo="yes"), "echo", []),
    (lambda m: ok(m, stream_options={"include_usage": "yes"}), "stream_options.include_usage", []),
    # structured output, honoured (serve/structured.py): a bad schema, regex or grammar names its field
    (lambda m: ok(m, response_format={"type": "xml"}), "response_format.type", []),
    (lambda m: ok(m, response_format={"type": "json_schema", "json_schema": {}}),
     "response_format.json_schema.schema", ["required"]),
    (lambda m: ok(m, structured_outputs={"json": {}, "regex": "a"}), "structured_outputs", ["exactly one"]),
    (lambda m: ok(m, guided_json="{not json"), "guided_json", ["not valid JSON"]),
    (lambda m: ok(m, guided_regex="(["), "guided_regex", ["regular expression"]),
    (lambda m: ok(m, guided_choice=[]), "guided_choice", []),
    (lambda m: ok(m, guided_grammar="root ::= "), "guided_grammar", ["EBNF"]),
    # fields nanoserve cannot honour: refused, never ignored (serve/unsupported.py)
    (lambda m: ok(m, guided_decoding_backend="outlines"), "guided_decoding_backend", ["xgrammar"]),
    (lambda m: ok(m, use_beam_search=True), "use_beam_search", ["offline"]),
    (lambda m: ok(m, allowed_token_ids=[1, 2]), "allowed_token_ids", []),
    (lambda m: ok(m, truncate_prompt_tokens=8), "truncate_prompt_tokens", []),
    (lambda m: ok(m, tool_choice="auto"), "tool_choice", ["function calling"]),
    (lambda m: ok(m, tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", []),
    (lambda m: ok(m, parallel_tool_calls=True), "parallel_tool_calls", ["function calling"]),
    (lambda m: ok(m, modalities=["text", "audio"]), "modalities", []),
    (lambda m: ok(m, reasoning_effort="high"), "reasoning_effort", []),
    (lambda m: ok(m, priority=3), "priority", []),
    # the fields nanoserve honours, with bad values
    (lambda m: ok(m, prompt_logprobs=-1), "prompt_logprobs", []),
    (lambda m: ok(m, prompt_logprobs=99), "prompt_logprobs", []),
    (lambda m: ok(m, prompt_logprobs="1"), "prompt_logprobs", []),
    (lambda m: ok(m, prompt_logprobs=1, stream=True), "prompt_logprobs", ["stream"]),
    (lambda m: ok(m, include_stop_str_in_output="yes"), "include_stop_str_in_output", []),
    (lambda m: ok(m, skip_special_tokens=1), "skip_special_tokens", []),
    (lambda m: ok(m, echo=True, max_tokens=0, prompt="x" * 500), "prompt", ["maximum context length"]),
]


@pytest.mark.parametrize("make, param, words", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (_, p, _) in
                                                                     enumerate(BAD_COMPLETIONS)])
def test_bad_completion_fields(server, loaded, make, param, words):
    url, _ = server
    assert_error(post(url, "/v1/completions", make(loaded.name)), 400, param, *words)


def test_fields_left_off_are_fine(server, loaded):
    """The "off" values of refused fields (what clients send by default) are no error."""
    url, _ = server
    for fields in ({"response_format": {"type": "text"}}, {"response_format": None}, {"use_beam_search": False},
                   {"guided_json": None}, {"allowed_token_ids": []}, {"some_future_field": 1},
                   {"tool_choice": "none"}, {"parallel_tool_calls": False}, {"modalities": ["text"]},
                   {"priority": 0}):
        assert post(url, "/v1/completions", ok(loaded.name, **fields)).status_code == 200, fields


BAD_ROUTES = [
    # (method, path, body, status, param, words)
    ("POST", "/tokenize", {}, 400, "prompt", ["either prompt"]),
    ("POST", "/tokenize", {"prompt": 5}, 400, "prompt", []),
    ("POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt", []),
    ("POST", "/tokenize", {"prompt": "a", "model": "gpt-17"}, 404, "model", []),
    ("POST", "/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens", []),
    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "a"}]}, 400, "messages", ["chat template"]),
    ("POST", "/detokenize", {"tokens": [1, 999999]}, 400, "tokens", ["outside the vocabulary"]),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens", []),
    ("POST", "/detokenize", {"tokens": "ab"}, 400, "tokens", []),
    ("POST", "/detokenize", {}, 400, "tokens", ["required"]),
    ("GET", "/v1/models/gpt-17", None, 404, "model", ["does not exist"]),
]


@pytest.mark.parametrize("method, path, body, status, param, words", BAD_ROUTES,
                         ids=[f"{p}-{i}" for i, (_, p, *_) in enumerate(BAD_ROUTES)])
def test_bad_input_to_the_new_routes(server, method, path, body, status, param, words):
    url, _ = server
    resp = post(url, path, body) if method == "POST" else httpx.get(url + path, timeout=30)
    assert_error(resp, status, param, *words)


def test_malformed_json_and_wrong_shapes(server, loaded):
    url, _ = server
    error = assert_error(post(url, "/v1/completions", b'{"model": "x", "prompt": '), 400)
    assert "not valid JSON" in error["message"] and error["type"] == "invalid_request_error"
    assert_error(post(url, "/v1/completions", b"[1, 2, 3]"), 400)
    assert_error(post(url, "/v1/chat/completions", {"model": loaded.name, "messages": "hi"}), 400, "messages")
    assert_error(post(url, "/v1/chat/completions", {"model": loaded.name, "messages": []}), 400, "messages")
    assert_error(post(url, "/v1/chat/completions", {"model": loaded.name, "messages": [{"role": "wizard",
                                                                                        "content": "hi"}]}),
                 400, "messages.0.role")


def test_chat_without_a_template_is_a_clear_400(server, loaded):
    url, _ = server
    body = {"model": loaded.name, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(url, "/v1/chat/completions", body), 400, "messages", "no chat template")


def test_chat_refuses_tool_fields_by_name(server, loaded):
    """tool_choice and parallel_tool_calls ask for function calling: refused like tools, never ignored."""
    url, _ = server
    body = {"model": loaded.name, "messages": [{"role": "user", "content": "hi"}]}
    for field, value in (("tool_choice", "auto"), ("tool_choice", "required"), ("parallel_tool_calls", True)):
        assert_error(post(url, "/v1/chat/completions", {**body, field: value}), 400, field, "function calling")


def test_unknown_model_is_404_for_the_openai_client(server, loaded):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as info:
        client(url).completions.create(model="gpt-17", prompt="Hello", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and loaded.name in info.value.body["message"]


def test_full_queue_is_429_then_the_server_recovers(server, loaded):
    """max_waiting=2: with the loop paused, two requests wait; the third is refused, with OpenAI's error."""
    url, srv = server
    srv.engine_loop.pause()
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            streams = [http.stream("POST", "/v1/completions", json=ok(loaded.name, stream=True)) for _ in range(2)]
            responses = [s.__enter__() for s in streams]      # 200 and headers: both admitted
            assert [r.status_code for r in responses] == [200, 200]
            assert on_engine(srv, lambda e: len(e.scheduler.waiting)) == 2
            with pytest.raises(openai.RateLimitError) as info:
                client(url).completions.create(model=loaded.name, prompt="one too many", max_tokens=2)
            assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
            srv.engine_loop.resume()
            for stream, response in zip(streams, responses):
                assert response.read().decode().rstrip().endswith("data: [DONE]")
                stream.__exit__(None, None, None)
    finally:
        srv.engine_loop.resume()
    assert client(url).completions.create(model=loaded.name, prompt="after", max_tokens=2).choices[0].text is not None
    rejected = [e for e in srv.book.table()["recent"] if e["state"] == "rejected"]
    assert rejected and "busy" in rejected[0]["detail"]


def test_server_is_up_and_clean_after_all_that(server, loaded):
    url, srv = server
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    resp = client(url).completions.create(model=loaded.name, prompt="Still here?", max_tokens=3)
    assert resp.choices[0].finish_reason in ("stop", "length")
    wait_idle(srv)
    check_clean(srv)


# -- API key ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(loaded):
    with running_server(loaded, api_key=KEY) as (url, srv):
        yield url, srv


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/snapshot", "/events", "/metrics", "/clients",
                                  "/version", "/tokenizer_info", "/v1/models/x", "POST /reset_prefix_cache",
                                  "POST /tokenize", "POST /detokenize"])
def test_every_route_needs_the_key(keyed, loaded, path):
    url, _ = keyed
    method, _, path = path.rpartition(" ")
    body = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [72]}}.get(path, {})

    def send(headers):
        if method == "POST":
            return httpx.post(url + path, json=body, headers=headers, timeout=10)
        return httpx.get(url + path.replace("/x", f"/{loaded.name}"), headers=headers, timeout=10)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert_error(send(headers), 401, None, "API key")
    if path != "/events":                                    # (an endless stream; its 200 is checked below)
        assert send({"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_wrong_key_is_401_for_the_openai_client_and_right_key_works(keyed, loaded):
    url, _ = keyed
    with pytest.raises(openai.AuthenticationError):
        client(url, api_key="wrong").completions.create(model=loaded.name, prompt="Hi", max_tokens=2)
    assert client(url, api_key=KEY).completions.create(model=loaded.name, prompt="Hi", max_tokens=2).choices
    with httpx.stream("GET", url + "/events", headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_lines())
    assert first == "id: 1"                                  # the EngineSynced batch


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")


def test_the_tokenizer_routes_of_a_model_without_a_tokenizer(tmp_path):
    from conftest import save_tiny

    loaded = load_model(save_tiny("tiny-llama", tmp_path / "no-tokenizer", with_tokenizer=False))
    with running_server(loaded) as (url, srv):
        assert_error(post(url, "/tokenize", {"prompt": "hi"}), 400, "prompt", "token ids")
        assert_error(post(url, "/detokenize", {"tokens": [1, 2]}), 400, "tokens", "token ids")
        assert_error(httpx.get(url + "/tokenizer_info", timeout=10), 404, None, "no tokenizer")
        resp = client(url).completions.create(model=loaded.name, prompt=[[1, 2, 3], [4, 5]], max_tokens=2,
                                              echo=True, logprobs=0)
        assert [len(c.logprobs.tokens) for c in resp.choices] == [5, 4]     # token ids, shown as numbers
        assert resp.choices[0].logprobs.tokens[:3] == ["1", "2", "3"]
