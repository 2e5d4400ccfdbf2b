"""`nanoserve serve` for real clients: what an evaluation harness, LangChain and the openai client send.

Batched prompts (text and token ids, n > 1, streaming) equal `LLM.generate` prompt by prompt with
choices numbered prompt * n + j; echo with logprobs puts the prompt's tokens first, their
log-probabilities equal to Hugging Face's log_softmax on the same weights; max_tokens=0 with echo;
vLLM's prompt_logprobs; the chat extras vLLM honours; vLLM's tokenizer routes (with the prefix cache's
count) and /reset_prefix_cache; /version and `--version` from the installed metadata;
`client.models.retrieve`; LangChain's `OpenAI` class. lm-evaluation-harness: test_serve_lm_eval.py.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from serve_helpers import CONFIG, check_clean, client, on_engine, running_server, wait_idle

PROMPTS = ["Hello", "The capital of France is", "abc"]
IDS = [[72, 101, 108, 108, 111], [66, 121, 101, 32, 98, 121, 101]]


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(loaded):
    with running_server(loaded) as (url, srv):
        yield url, srv


def hf_token_logprobs(hf, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under Hugging Face's forward."""
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def raw(url: str, path: str, body: dict) -> dict:
    resp = httpx.post(url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


# -- /v1/models/{id} -------------------------------------------------------------------------------


def test_models_retrieve(server, loaded):
    url, _ = server
    model = client(url).models.retrieve(loaded.name)
    assert model.id == loaded.name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client(url).models.retrieve("gpt-17")
    assert info.value.body["code"] == "model_not_found"


# -- batched prompts --------------------------------------------------------------------------------


@pytest.mark.parametrize("prompts", [PROMPTS, IDS], ids=["text", "token-ids"])
def test_a_batch_of_prompts_is_a_request_per_prompt(server, offline, loaded, prompts):
    url, _ = server
    resp = client(url).completions.create(model=loaded.name, prompt=prompts, max_tokens=6, n=2, temperature=0.9,
                                          seed=11)
    assert [c.index for c in resp.choices] == list(range(2 * len(prompts)))
    for i, prompt in enumerate(prompts):
        want = offline([prompt], max_tokens=6, n=2, temperature=0.9, seed=11)[0]
        for j in range(2):
            assert resp.choices[i * 2 + j].text == want.outputs[j].text
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for p in prompts
                                               for c in offline([p], max_tokens=6, n=2, temperature=0.9,
                                                                seed=11)[0].outputs)


def test_a_streamed_batch_equals_the_whole_one(server, loaded):
    url, _ = server
    args = dict(model=loaded.name, prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    whole = client(url).completions.create(**args)
    texts, reasons, usage = {}, {}, None
    for chunk in client(url).completions.create(**args, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage


# -- echo and prompt log-probabilities ------------------------------------------------------------


def test_echo_with_logprobs_puts_the_prompt_first(server, offline, loaded, hf):
    url, _ = server
    tokenizer = loaded.tokenizer
    for prompt in (PROMPTS[1], IDS[1]):
        resp = client(url).completions.create(model=loaded.name, prompt=prompt, max_tokens=4, temperature=0,
                                              echo=True, logprobs=2)
        want = offline([prompt], max_tokens=4, temperature=0)[0]
        ids = list(want.prompt_token_ids)
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        choice, lp = resp.choices[0], resp.choices[0].logprobs
        assert choice.text == text + want.outputs[0].text
        assert lp.tokens == [tokenizer.decode([t]) for t in ids + want.outputs[0].token_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(hf_token_logprobs(hf, ids), abs=1e-4)
        for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert chosen in top.values() and len(top) <= 3 and max(top.values()) >= chosen
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]


def test_echo_with_max_tokens_0_gives_the_prompt_only(server, loaded, hf):
    """What perplexity and lm-eval's loglikelihood need: the prompt's log-probabilities, nothing generated."""
    url, _ = server
    resp = client(url).completions.create(model=loaded.name, prompt=IDS, max_tokens=0, echo=True, logprobs=0)
    for i, ids in enumerate(IDS):
        choice = resp.choices[i]
        assert choice.text == loaded.tokenizer.decode(ids) and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(hf_token_logprobs(hf, ids), abs=1e-4)
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == sum(map(len, IDS))


def test_a_streamed_echo_equals_the_whole_one(server, loaded):
    url, _ = server
    args = dict(model=loaded.name, prompt=PROMPTS[:2], max_tokens=5, temperature=0, echo=True, logprobs=1)
    whole = client(url).completions.create(**args)
    texts, tokens, first = {}, {}, {}
    for chunk in client(url).completions.create(**args, stream=True):
        for c in chunk.choices:
            first.setdefault(c.index, c.text)
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
    assert first == {0: whole.choices[0].text[:len(first[0])], 1: whole.choices[1].text[:len(first[1])]}
    assert first[0].startswith(PROMPTS[0]) and first[1].startswith(PROMPTS[1])
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}


def test_prompt_logprobs_in_vllms_shape(server, loaded, hf):
    url, _ = server
    ids = IDS[0]
    want = hf_token_logprobs(hf, ids)
    completion = raw(url, "/v1/completions", {"model": loaded.name, "prompt": ids, "max_tokens": 1,
                                              "prompt_logprobs": 2})
    chat = raw(url, "/v1/chat/completions", {"model": loaded.name, "max_tokens": 1, "prompt_logprobs": 0,
                                             "messages": [{"role": "user", "content": "hi"}]})
    shaped = completion["choices"][0]["prompt_logprobs"]
    assert shaped[0] is None and len(shaped) == len(ids)
    for pos, entry in enumerate(shaped[1:], 1):
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(want[pos - 1], abs=1e-4)
        assert entry[str(ids[pos])]["decoded_token"] == loaded.tokenizer.decode([ids[pos]])
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks == [1, 2] and len(entry) in (2, 3)
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


# -- the chat extras ----------------------------------------------------------------------------------


def tokenize(url: str, **body) -> dict:
    return raw(url, "/tokenize", body)


def test_chat_template_kwargs_continue_final_message_and_echo(server, loaded):
    url, _ = server
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    plain = client(url).chat.completions.create(model=loaded.name, messages=messages[:1], max_tokens=2,
                                                temperature=0)
    noted = client(url).chat.completions.create(model=loaded.name, messages=messages[:1], max_tokens=2, temperature=0,
                                                extra_body={"chat_template_kwargs": {"note": "be brief"}})
    count = tokenize(url, messages=messages[:1], chat_template_kwargs={"note": "be brief"})["count"]
    assert noted.usage.prompt_tokens == count == plain.usage.prompt_tokens + len("<|note|>be brief\n")
    going_on = client(url).chat.completions.create(
        model=loaded.name, messages=messages, max_tokens=3, temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    want = tokenize(url, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert going_on.usage.prompt_tokens == want["count"]
    assert loaded.tokenizer.decode(want["tokens"]).endswith("<|assistant|>Hi the")   # unterminated
    assert going_on.choices[0].message.content.startswith("Hi the")


# -- vLLM's routes ------------------------------------------------------------------------------------


def test_tokenize_detokenize_tokenizer_info(server, loaded):
    url, srv = server
    tokenizer = loaded.tokenizer
    text = "Tokenize me, please."
    got = tokenize(url, prompt=text, return_token_strs=True)
    assert got["tokens"] == tokenizer(text).input_ids and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == srv.max_model_len
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    assert raw(url, "/detokenize", {"tokens": got["tokens"]}) == {"prompt": text}
    info = httpx.get(url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    chat = tokenize(url, messages=[{"role": "user", "content": "hi"}])
    assert chat["tokens"] == tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                      tokenize=False, add_generation_prompt=True),
                                       add_special_tokens=False).input_ids


def test_tokenize_counts_the_cached_prefix_and_reset_clears_it(server, loaded):
    url, srv = server
    prompt = "A prompt of a little more than twenty tokens."
    raw(url, "/reset_prefix_cache", {})
    assert tokenize(url, prompt=prompt)["cached_tokens"] == 0
    client(url).completions.create(model=loaded.name, prompt=prompt, max_tokens=2)
    wait_idle(srv)
    n = tokenize(url, prompt=prompt)["count"]
    block = CONFIG["block_size"]
    assert tokenize(url, prompt=prompt)["cached_tokens"] == (n - 1) // block * block    # all but the last token
    assert raw(url, "/reset_prefix_cache", {})["freed_blocks"] > 0
    assert tokenize(url, prompt=prompt)["cached_tokens"] == 0


def test_version_is_the_installed_one(server, capsys):
    url, _ = server
    version = importlib.metadata.version("nanoserve")
    assert httpx.get(url + "/version", timeout=10).json() == {"version": version}
    for argv in ([sys.executable, "-m", "nanoserve", "--version"], [sys.executable, "-m", "nanoserve.cli",
                                                                    "--version"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == f"nanoserve {version}\n", done.stderr
    import nanoserve

    assert nanoserve.__version__ == version


# -- engine fields through the server -----------------------------------------------------------------


def test_include_stop_str_in_output_and_skip_special_tokens(server, loaded):
    url, srv = server
    text = client(url).completions.create(model=loaded.name, prompt="abc", max_tokens=16, temperature=0).choices[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    kept = client(url).completions.create(model=loaded.name, prompt="abc", max_tokens=16, temperature=0, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == text[:text.index(stop) + 2]
    added = []                                       # what the engine was asked for (its RequestAdded events)
    on_engine(srv, lambda e: e.subscribe(lambda ev: added.append(dict(ev.params)) if hasattr(ev, "params") else 0))
    client(url).completions.create(model=loaded.name, prompt="abc", max_tokens=2,
                                   extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert added[-1]["skip_special_tokens"] is False and added[-1]["include_stop_str_in_output"] is True


# -- LangChain ----------------------------------------------------------------------------------------


def test_langchains_openai_class(server, offline, loaded):
    """LangChain's `OpenAI` sends `prompt` as a list even for one prompt, and batches several in one request."""
    import langchain_openai  # (a dev dependency)

    url, _ = server
    llm = langchain_openai.OpenAI(base_url=f"{url}/v1", api_key="none", model=loaded.name, max_tokens=6,
                                  temperature=0, max_retries=0)
    assert llm.invoke(PROMPTS[1]) == offline([PROMPTS[1]], max_tokens=6, temperature=0)[0].outputs[0].text
    assert llm.batch(PROMPTS) == [o.outputs[0].text for o in offline(PROMPTS, max_tokens=6, temperature=0)]


# -- bad input to the new chat fields: a 400 naming the field, and the server goes on ------------------

USER = [{"role": "user", "content": "hi"}]
BAD_CHATS = [
    (dict(continue_final_message=True), "continue_final_message", ["add_generation_prompt=false"]),
    (dict(continue_final_message=True, add_generation_prompt=False), "continue_final_message", ["assistant"]),
    (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs.tokenize", ["apply_chat_template"]),
    (dict(chat_template_kwargs={"chat_template": "{{ 7 }}"}), "chat_template_kwargs.chat_template", []),
    (dict(chat_template_kwargs="note"), "chat_template_kwargs", []),
    (dict(chat_template="{{ messages }}"), "chat_template", ["model's own"]),
    (dict(echo="yes"), "echo", []),
    (dict(add_generation_prompt=1), "add_generation_prompt", []),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema",
     ["required"]),
    (dict(guided_choice=["yes", 3]), "guided_choice.1", []),
    (dict(functions=[{"name": "f"}]), "functions", []),
    (dict(prompt_logprobs=2, stream=True), "prompt_logprobs", ["stream"]),
]


@pytest.mark.parametrize("fields, param, words", BAD_CHATS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_CHATS)])
def test_bad_chat_fields(server, loaded, fields, param, words):
    url, _ = server
    resp = httpx.post(url + "/v1/chat/completions", timeout=30,
                      json={"model": loaded.name, "messages": USER, "max_tokens": 2, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_bad_tokenize_chat_and_the_server_goes_on(server, loaded):
    url, srv = server
    resp = httpx.post(url + "/tokenize", timeout=30, json={"messages": USER, "chat_template_kwargs": {"tools": []}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs.tools"
    assert client(url).chat.completions.create(model=loaded.name, messages=USER, max_tokens=2).choices
    wait_idle(srv)
    check_clean(srv)
