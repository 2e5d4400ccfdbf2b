"""The server fuzzed from its own OpenAPI schema (schemathesis), briefly: no 5xx, every error
OpenAI-shaped, and afterwards the engine thread alive, nothing left behind. The long run is
benchmarks/fuzz_server.py."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("schemathesis")

from serve_fuzz import SKIPPED, check_server, fuzz  # noqa: E402
from serve_helpers import running_server, save_chat_model  # noqa: E402

from nanoserve.models.loader import load_model  # noqa: E402

# A small context: any generated request (max_tokens and n included) finishes in a few steps.
CONFIG = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)


def test_schemathesis_finds_no_server_error(tmp_path):
    loaded = load_model(save_chat_model(tmp_path / "chat-llama"))
    with running_server(loaded, CONFIG, max_waiting=8) as (url, server):
        stats = fuzz(url, loaded.name, examples=6, seed=0)
        check_server(url, server)
        paths = httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]
    operations = sum(len(methods) for path, methods in paths.items() if path not in SKIPPED)
    assert operations >= 13 and stats["operations"] == operations     # every route, vLLM's included
    assert stats["cases"] >= operations * 2
    assert stats["status 200"] > 0 and stats["status 400"] > 0
