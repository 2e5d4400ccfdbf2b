"""An HTTP-level fuzz of `nanoserve serve` from its own OpenAPI schema, with schemathesis.

schemathesis reads the server's /openapi.json (FastAPI builds it from the pydantic models of
`protocol.py`) and generates requests for every operation: valid ones (positive mode) and
ones that break the schema (negative mode: wrong types, missing fields, values out of range).
Half of the generated bodies are steered towards the engine (`steer`): the served model's name,
no field nanoserve refuses outright, a prompt and n that fit; the sampling fields stay as
generated, so the engine samples with whatever values the schema allows. Every response must not be a server error (schemathesis' `not_a_server_error`
check), and every error body must have the OpenAI shape. GET /events is left out: it is an
endless stream by design (its parameters are checked by the server tests).

After the run, `check_server` says the server is still whole: the engine thread alive and
/health 200, no request left in the engine or in the clients table, the engine's invariants
hold and only the prefix cache holds blocks.

    stats = fuzz(url, model, examples=20, seed=0)      # {"operations": 13, "cases": ..., "status 200": ...}
    check_server(url, server)

tests/test_serve_fuzz.py runs it briefly in CI; benchmarks/fuzz_server.py runs it long.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

SKIPPED = ("/events",)      # an endless SSE stream


def fuzz(url: str, model: str, examples: int, seed: int = 0, log=None) -> Counter:
    """Run `examples` generated cases per operation and mode; returns counts (cases, statuses).
    Raises on the first server error or error body that is not OpenAI-shaped."""
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    stats: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in SKIPPED:
            continue
        stats["operations"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans())

            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(strategy)
            def run(pair) -> None:
                case, steered = pair
                if steered and isinstance(case.body, dict):
                    steer(case.body, model)
                try:
                    response = case.call(base_url=url, timeout=120)
                    stats["cases"] += 1
                    stats[f"status {response.status_code}"] += 1
                    case.validate_response(response, checks=[not_a_server_error])
                    if response.status_code >= 400:
                        error = response.json().get("error")
                        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, (
                            f"{case.method} {case.path}: {response.status_code} {response.text[:200]}")
                except Exception as exc:
                    if log:                              # (Hypothesis may report it later as flaky: say it now)
                        log(f"  failure: {case.method} {case.path} body={case.body!r:.300} -> "
                            f"{type(exc).__name__}: {str(exc)[:500]}")
                    raise

            try:
                hypothesis_seed(seed)(run)()
            except Unsatisfiable:        # an operation without parameters has no invalid input to make
                if mode is not GenerationMode.NEGATIVE:
                    raise
                stats["operations with nothing to break"] += 1
            if log:
                log(f"  {operation.label} ({mode.value}): {stats['cases']} cases so far")
    return stats


UNSUPPORTED = ("best_of", "suffix", "logit_bias", "tools")     # refused with a 400 whatever their value


def steer(body: dict, model: str) -> None:
    """Past the 404 and the refusals that say nothing about the engine: into a step."""
    body["model"] = model
    for name in UNSUPPORTED:
        body.pop(name, None)
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)                 # (a 400 without chat's logprobs=true)
    if "prompt" in body and not (isinstance(body["prompt"], str) and 0 < len(body["prompt"]) < 40):
        body["prompt"] = "Hello there"
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:2] or [{"role": "user", "content": "Hi"}]
    if isinstance(body.get("n"), int):
        body["n"] = 1 + body["n"] % 4
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(name), int):
            body[name] = 1 + body[name] % 16


def check_server(url: str, server, timeout: float = 120.0) -> None:
    """The server is whole: engine thread alive, /health ok, nothing left anywhere, invariants hold."""
    assert server.engine_loop.alive and server.engine_loop.error is None, server.engine_loop.error
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    deadline = time.monotonic() + timeout

    def state(engine):
        engine.check_invariants()
        cached = engine.radix.num_cached_blocks if engine.radix else 0
        return bool(engine.requests or engine.sequences), engine.pool.num_used_blocks - cached

    while True:
        busy, leaked = server.engine_loop.call(state).result(30)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not busy, "requests are left in the engine"
    assert leaked == 0, f"{leaked} blocks held by no request and not by the prefix cache"
    assert not server.book.live, f"requests left in the clients table: {list(server.book.live)}"
