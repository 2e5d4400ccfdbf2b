"""Structured output over HTTP cannot stall the server or answer 500: grammars compile off the engine
thread (a slow one holds only its own request), are bounded before compiling (size, rules, repeats)
and by a deadline, and a constraint that can never be met is a 400 naming the client's field, at
admission where that can be known and while decoding otherwise (serve/grammars.py)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import check_clean, running_server, wait_idle

from nanoserve import structured_output
from nanoserve.models.loader import load_model
from nanoserve.serve import grammars

SLOW = 'root ::= "slow" [a-z]*'      # the grammar the tests hold at its compile


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def server(loaded):
    with running_server(loaded) as (url, srv):
        yield url, srv


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def completion(model: str, **fields) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}


def assert_400(resp: httpx.Response, param: str, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


@pytest.fixture()
def gate(monkeypatch):
    """Holds the compile of SLOW until released; records the thread each compile ran on."""
    opened, entered, threads = threading.Event(), threading.Event(), []
    compile_ = structured_output.GrammarCompiler.compile

    def held(self, spec):
        threads.append((spec.grammar, threading.current_thread().name))
        if spec.grammar == SLOW:
            entered.set()
            assert opened.wait(60), "the gate was never opened"
        return compile_(self, spec)

    monkeypatch.setattr(structured_output.GrammarCompiler, "compile", held)
    yield opened, entered, threads
    opened.set()


def test_a_slow_compile_holds_only_its_own_request(server, loaded, gate):
    url, srv = server
    opened, entered, threads = gate
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, url, completion(loaded.name, guided_grammar=SLOW, max_tokens=6))
        assert entered.wait(60)
        # the grammar is compiling (held): short requests, plain and constrained, are served meanwhile
        shorts = [post(url, completion(loaded.name, max_tokens=2)) for _ in range(3)]
        shorts.append(post(url, completion(loaded.name, guided_choice=["yes", "no"])))
        assert [r.status_code for r in shorts] == [200] * 4 and not slow.done()
        opened.set()
        resp = slow.result(60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].startswith("slow")
    first = next(name for grammar, name in threads if grammar == SLOW)   # the compile that was held
    assert first.startswith("nanoserve-grammar"), threads
    wait_idle(srv)
    check_clean(srv)


def test_a_compile_past_its_deadline_is_refused(server, loaded, gate, monkeypatch):
    url, srv = server
    opened, entered, _ = gate
    monkeypatch.setattr(srv.grammars, "deadline_s", 0.05)
    resp = post(url, completion(loaded.name, guided_grammar=SLOW))
    assert entered.is_set()          # (the compile was still held when the answer came)
    assert_400(resp, "guided_grammar", "did not compile", "within")
    opened.set()
    assert post(url, completion(loaded.name, max_tokens=2)).status_code == 200


def rules(n: int) -> str:
    return "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n" + "".join(f'r{i} ::= "{i}"\n' for i in range(n))


TOO_LARGE = [
    # (fields, param, words)
    ({"guided_grammar": rules(grammars.MAX_RULES + 10)}, "guided_grammar", ["rules"]),
    ({"guided_grammar": 'root ::= [a-z]{0,5000}'}, "guided_grammar", ["add up to 5000"]),
    ({"guided_grammar": 'root ::= [a-z]{0,100} "x" [a-z]{3,100}'}, "guided_grammar", ["add up to 200"]),
    ({"guided_regex": "(ab){0,9999}"}, "guided_regex", ["9999"]),
    ({"guided_regex": "a{" + "9" * 5000 + "}"}, "guided_regex", []),
    ({"guided_regex": "a" * 70_000}, "guided_regex", ["characters"]),
    ({"guided_choice": [f"c{i}" for i in range(20_000)]}, "guided_choice", ["characters"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}}}},
     "response_format.json_schema.schema", []),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 100_000}},
     "guided_json", ["repeats", "maxItems", "4096"]),
]


@pytest.mark.parametrize("fields, param, words", TOO_LARGE, ids=[p for _, p, _ in TOO_LARGE])
def test_a_grammar_too_large_to_compile_is_refused_by_name(server, loaded, fields, param, words):
    url, _ = server
    assert_400(post(url, completion(loaded.name, **fields)), param, *words)


UNSATISFIABLE = [
    # (fields, param, words): refused at admission, nothing queued
    ({"guided_regex": "[^\\x00-\\U0010ffff]"}, "guided_regex", ["no token"]),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", ["no token"]),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", ["no token"]),
    ({"guided_choice": ["yes", "no"], "min_tokens": 5}, "min_tokens", ["longest choice", "guided_choice"]),
    ({"guided_choice": ["yes", "no"], "min_tokens": 5, "n": 2}, "min_tokens", []),
]


@pytest.mark.parametrize("fields, param, words", UNSATISFIABLE, ids=[p for _, p, _ in UNSATISFIABLE])
def test_an_unsatisfiable_constraint_is_a_400_at_admission(server, loaded, fields, param, words):
    url, srv = server
    assert_400(post(url, completion(loaded.name, **fields)), param, *words)
    check_clean(srv)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_found_unsatisfiable_while_decoding_ends_that_request_with_a_400(server, loaded, stream):
    """ "ab" then only EOS, which min_tokens=3 forbids: known only at output position 2. That request
    gets an OpenAI-shaped error naming its field (in the stream: an error event); its neighbour is fine."""
    url, srv = server
    body = completion(loaded.name, guided_grammar='root ::= "ab"', min_tokens=3, stream=stream)
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(post, url, completion(loaded.name, max_tokens=6))
        resp = post(url, body)
        assert other.result(60).status_code == 200
    if not stream:
        assert_400(resp, "guided_grammar", "cannot be satisfied", "min_tokens=3")
    else:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        error = events[-1]["error"]
        assert error["param"] == "guided_grammar" and error["type"] == "invalid_request_error"
    wait_idle(srv)
    check_clean(srv)
