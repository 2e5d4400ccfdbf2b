"""Load and faults on loopback: 64 concurrent streaming clients (the official async openai client),
a quarter of them hanging up mid-stream. Afterwards every completed response equals the offline
result, the aborted requests are gone from the engine (and the trace says they were aborted),
check_invariants() passes and no block is held except by the prefix cache."""

from __future__ import annotations

import asyncio

import openai
import pytest
from serve_helpers import check_clean, on_engine, running_server, wait_idle

from nanoserve import LLM, SamplingParams
from nanoserve.events import Preempted, PrefixMatched, SequenceAborted
from nanoserve.models.loader import load_model
from nanoserve.trace import read_trace

NUM_CLIENTS, HANG_UP_EVERY = 64, 4
# A pool that cannot hold everyone (preemption happens) and a budget that chunks prefills.
CONFIG = dict(block_size=4, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=48)
TOPICS = ["paged attention", "a KV cache", "continuous batching", "a radix tree", "preemption", "beam search",
          "speculative decoding", "a block table"]


def prompt(i: int) -> str:
    return f"Question {i}: what is {TOPICS[i % len(TOPICS)]}? Answer:"     # shared prefixes, distinct prompts


def max_tokens(i: int) -> int:
    return 200 if i % HANG_UP_EVERY == 0 else 6 + i % 11   # hang-ups ask for more than they will wait for


async def one_client(url: str, model: str, i: int) -> tuple[int, str, str | None]:
    """Stream a completion -> (i, request id, text); every HANG_UP_EVERY-th client hangs up after 3 chunks
    (text None)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        hang_up = i % HANG_UP_EVERY == 0
        stream = await client.completions.create(model=model, prompt=prompt(i), max_tokens=max_tokens(i),
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": hang_up})   # (vLLM's extra field)
        text, chunks = "", 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text if chunk.choices else ""
            if hang_up and chunks == 3:
                await stream.close()                     # hang up mid-stream
                return i, chunk.id, None
        return i, chunk.id, text


async def all_clients(url: str, model: str) -> list[tuple[int, str, str | None]]:
    return await asyncio.wait_for(asyncio.gather(*(one_client(url, model, i) for i in range(NUM_CLIENTS))),
                                  timeout=300)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def test_64_streaming_clients_with_hang_ups(loaded, tiny_llama_dir, tmp_path):
    trace = tmp_path / "load.jsonl"
    with running_server(loaded, CONFIG, max_waiting=NUM_CLIENTS, record=trace) as (url, srv):
        results = asyncio.run(all_clients(url, loaded.name))
        wait_idle(srv)
        check_clean(srv)
        finished_ids = on_engine(srv, lambda e: set(e.table.finished_ids))
        book = srv.book.table()

    completed = {i: text for i, _, text in results if text is not None}
    hung_up = {rid for i, rid, text in results if text is None}
    assert len(hung_up) == NUM_CLIENTS // HANG_UP_EVERY and len(completed) == NUM_CLIENTS - len(hung_up)

    # Every completed stream equals offline greedy generation on the same weights.
    llm = LLM(tiny_llama_dir, **CONFIG)
    offline = llm.generate([prompt(i) for i in completed],
                           [SamplingParams(max_tokens=max_tokens(i), temperature=0) for i in completed], use_tqdm=False)
    assert [completed[i] for i in completed] == [o.outputs[0].text for o in offline]

    # The hang-ups, and only they, were aborted by the server when their connections closed; they are gone.
    events = read_trace(trace)
    aborted = {e.seq_id for e in events if isinstance(e, SequenceAborted)}
    assert aborted == hung_up
    assert aborted <= finished_ids                          # the engine knows them only as over
    assert not book["live"]
    assert {e["state"] for e in book["recent"]} <= {"done", "disconnected"}
    # and the load was real: requests were preempted, prompts hit the prefix cache
    assert any(isinstance(e, Preempted) for e in events)
    assert any(isinstance(e, PrefixMatched) and e.num_hit_tokens for e in events)
