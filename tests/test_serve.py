"""`nanoserve serve` with the official openai client: completions and chat, streaming and not,
n=2, logprobs, usage; greedy (and seeded) text equals `LLM.generate` on the same prompts.
Also /v1/models, /snapshot, /metrics, /health and --record."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import client, on_engine, running_server, wait_idle

from nanoserve.trace import fold, fold_all, read_trace, synced_event

PROMPTS = ["Hello", "The capital of France is", "Once upon a time, in a land far away,", "abc"]


@pytest.fixture(scope="module")
def server(loaded, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "serve.jsonl"
    with running_server(loaded, record=trace) as (url, srv):
        yield url, srv, trace


def test_models_lists_the_served_model(server, loaded):
    url, srv, _ = server
    models = client(url).models.list().data
    assert [m.id for m in models] == [loaded.name]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_llm_generate(server, offline, loaded, prompt):
    url, _, _ = server
    resp = client(url).completions.create(model=loaded.name, prompt=prompt, max_tokens=12, temperature=0)
    want = offline([prompt], max_tokens=12, temperature=0)[0]
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.choices[0].finish_reason == want.outputs[0].finish_reason
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streamed_completion_equals_whole(server, offline, loaded):
    url, _, _ = server
    stream = client(url).completions.create(model=loaded.name, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    want = offline([PROMPTS[1]], max_tokens=20, temperature=0)[0].outputs[0]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20   # include_usage: last chunk


def test_completion_token_id_prompt(server, offline, loaded):
    url, _, _ = server
    ids = [72, 101, 108, 108, 111]
    resp = client(url).completions.create(model=loaded.name, prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == offline([ids], max_tokens=8, temperature=0)[0].outputs[0].text


def test_chat_greedy_equals_llm_generate_on_the_template(server, offline, loaded):
    url, _, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    resp = client(url).chat.completions.create(model=loaded.name, messages=messages, max_tokens=16, temperature=0)
    prompt = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = offline([prompt], max_tokens=16, temperature=0)[0].outputs[0]
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].message.role == "assistant" and resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")


def test_chat_streaming_equals_whole(server, loaded):
    url, _, _ = server
    c = client(url)
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = c.chat.completions.create(model=loaded.name, messages=messages, max_tokens=24, temperature=0)
    chunks = list(c.chat.completions.create(model=loaded.name, messages=messages, max_tokens=24, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n2_sampled_with_a_seed_equals_offline(server, offline, loaded):
    """n=2 forks one prefill; with a seed each completion is reproducible, so the server equals LLM.generate."""
    url, _, _ = server
    resp = client(url).completions.create(model=loaded.name, prompt="Pick a number:", max_tokens=10, n=2,
                                          temperature=1.0, seed=7)
    want = offline(["Pick a number:"], max_tokens=10, n=2, temperature=1.0, seed=7)[0]
    assert [ch.index for ch in resp.choices] == [0, 1]
    assert [ch.text for ch in resp.choices] == [o.text for o in want.outputs]
    assert resp.usage.completion_tokens == 20


def test_n2_streaming_chat(server, loaded):
    url, _, _ = server
    c = client(url)
    args = dict(model=loaded.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, n=2,
                temperature=0.9, seed=3)
    whole = c.chat.completions.create(**args)
    texts = {0: "", 1: ""}
    for chunk in c.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [ch.message.content for ch in whole.choices]


def test_logprobs_are_the_engines(server, offline, loaded):
    url, _, _ = server
    resp = client(url).completions.create(model=loaded.name, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    want = offline(["Hello"], max_tokens=5, temperature=0, logprobs=2)[0].outputs[0]
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(want.logprobs, want.token_ids)])
    assert all(len(top) <= 3 for top in lp.top_logprobs)      # the chosen token plus the 2 best


def test_stop_string_and_finish_reason(server, offline, loaded):
    url, _, _ = server
    text = offline(["abc"], max_tokens=24, temperature=0)[0].outputs[0].text
    # a stop string from the middle of the greedy text: a character first seen there (the tiny random model
    # writes stray bytes; U+FFFD stands for half a character and cannot be one)
    starts = [i for i in range(2, len(text)) if text[i] != "\ufffd" and text.find(text[i]) == i]
    assert starts, f"no usable stop string in {text!r}"
    stop = text[starts[0]]
    resp = client(url).completions.create(model=loaded.name, prompt="abc", max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].text == text[: starts[0]]


def test_snapshot_health_and_metrics(server, loaded):
    url, srv, _ = server
    wait_idle(srv)
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").json()["status"] == "ok"
        snap = http.get("/snapshot").json()
        assert snap == on_engine(srv, lambda e: e.snapshot())
        text = http.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    blocks = {s.labels["state"]: s.value for s in families["nanoserve_kv_blocks"].samples}
    assert sum(blocks.values()) == snap["pool"]["num_blocks"]
    ttft_count = next(s.value for s in families["nanoserve_time_to_first_token_seconds"].samples
                      if s.name.endswith("_count"))
    finished = sum(s.value for s in families["nanoserve_requests_finished"].samples if s.name.endswith("_total"))
    assert ttft_count == finished > 0                 # every finished request had a first token
    assert families["nanoserve_generation_tokens"].samples[0].value > 0
    assert {s.labels["state"] for s in families["nanoserve_requests"].samples} == {"running", "waiting", "swapped"}


def test_record_writes_a_replayable_trace(server, loaded):
    """--record: the trace folds to the engine's state (the same pool, free queue and tree as /snapshot)."""
    url, srv, trace = server
    client(url).completions.create(model=loaded.name, prompt="Record me", max_tokens=4, temperature=0)
    wait_idle(srv)
    snap = on_engine(srv, lambda e: e.snapshot())
    replayed, now = fold_all(read_trace(trace)), fold(None, synced_event(snap))
    assert (replayed.ref_counts, replayed.free_queue) == (now.ref_counts, now.free_queue)
    assert replayed.radix.keys() == now.radix.keys()
