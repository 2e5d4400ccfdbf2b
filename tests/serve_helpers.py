"""Shared pieces of the server tests: a tiny model with a chat template, a server on a loopback port.

A server runs in a background thread (uvicorn on 127.0.0.1, a port the OS
picks), its engine built from a model loaded once per test session; every
server is stopped when its `with` block ends.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import openai  # noqa: E402

from nanoserve import EngineConfig, LLMEngine  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.background import BackgroundServer  # noqa: E402

# A chat template for the byte-level tokenizer of the tiny test models; `note` is a template variable
# (chat_template_kwargs sets it).
CHAT_TEMPLATE = ("{% if note is defined %}<|note|>{{ note }}\n{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Small enough to chunk prefills and batch many requests; big enough for 64 clients.
CONFIG = dict(block_size=4, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=64)


def save_chat_model(path) -> str:
    """tiny-llama saved to `path` with a tokenizer that has a chat template."""
    from conftest import save_tiny
    from transformers import AutoTokenizer

    save_tiny("tiny-llama", path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@contextmanager
def running_server(loaded, config: dict | None = None, **app_options):
    """A server for `loaded` (a LoadedModel) on a loopback port; yields (server url, the app's Server)."""
    engine = LLMEngine(EngineConfig(model=loaded.name, **(config or CONFIG)), loaded=loaded)
    app = build_app(engine, **app_options)
    with BackgroundServer(app) as background:
        yield background.url, app.state.server


def client(url: str, api_key: str = "none", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)


def on_engine(server, fn, timeout: float = 30.0):
    """Run fn(engine) on the server's engine thread, between two steps; its result."""
    return server.engine_loop.call(fn).result(timeout)


def wait_idle(server, timeout: float = 60.0) -> None:
    """Until the engine has no unfinished request (aborts land between steps)."""
    deadline = time.monotonic() + timeout
    while on_engine(server, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "the server's engine did not go idle"
        time.sleep(0.02)


def check_clean(server) -> None:
    """No request left, invariants hold, and only the prefix cache holds blocks."""
    def check(engine):
        engine.check_invariants()
        cached = engine.radix.num_cached_blocks if engine.radix else 0
        return not engine.sequences and not engine.requests, engine.pool.num_used_blocks, cached

    empty, used, cached = on_engine(server, check)
    assert empty, "requests are left in the engine"
    assert used == cached, f"{used - cached} blocks held by no request and not by the prefix cache"
