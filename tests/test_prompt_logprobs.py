"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) and `include_stop_str_in_output`.

Prompt log-probabilities equal Hugging Face's log_softmax over the same weights (float32), whatever
the token budget (chunked prefill), the block size, the batch; a prefix-cache hit does not lose them
(such a request does not read the cache, and still fills it); preemption by recompute, n > 1 and beam
search keep them; the state machine (test_engine_stateful.py) compares them with a mechanisms-off
engine under every mechanism at once.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, run_to_end
from transformers import AutoModelForCausalLM

from nanoserve import SamplingParams
from nanoserve import events as ev
from nanoserve.errors import FieldError

PROMPTS = [list(range(3, 40)), [72, 101, 108, 108, 111, 32, 119], list(range(200, 213)), [9]]


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: row i is log p(. | prompt[:i + 1]) under Hugging Face's forward."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def run(engine, prompts, **params) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0, **params))
    outs = run_to_end(engine)
    return {int(rid[1:]): out for rid, out in outs.items()}


@pytest.mark.parametrize("block_size, budget", [(16, 512), (4, 7), (1, 3), (3, 16)])
def test_equal_hugging_face_whatever_the_chunking(tiny_llama, hf, block_size, budget):
    engine = make_engine(tiny_llama, block_size=block_size, num_blocks=256, max_num_batched_tokens=budget)
    outs = run(engine, PROMPTS, prompt_logprobs=3)
    for i, prompt in enumerate(PROMPTS):
        got = outs[i].prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        if len(prompt) == 1:
            continue
        want = hf_logprobs(hf, prompt)
        top_vals, top_ids = want.topk(3, dim=-1)
        for pos in range(1, len(prompt)):
            entry, row = got[pos], want[pos - 1]
            assert entry[prompt[pos]] == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
            assert set(entry) == set(top_ids[pos - 1].tolist()) | {prompt[pos]}
            for token, value in entry.items():
                assert value == pytest.approx(row[token].item(), abs=1e-4)


def test_chunked_prefill_gives_the_numbers_of_one_chunk(tiny_llama):
    whole = run(make_engine(tiny_llama, block_size=4, num_blocks=256, max_num_batched_tokens=512), PROMPTS,
                prompt_logprobs=2)
    for budget in (2, 5, 11):
        chunked = run(make_engine(tiny_llama, block_size=4, num_blocks=256, max_num_batched_tokens=budget),
                      PROMPTS, prompt_logprobs=2)
        for i in range(len(PROMPTS)):
            for a, b in zip(whole[i].prompt_logprobs[1:], chunked[i].prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                assert list(b.values()) == pytest.approx(list(a.values()), abs=1e-5)


def test_without_the_field_there_are_none(tiny_llama):
    outs = run(make_engine(tiny_llama, block_size=4, num_blocks=64), PROMPTS[:1])
    assert outs[0].prompt_logprobs is None


def test_a_prefix_cache_hit_does_not_lose_them(tiny_llama):
    """The prompt is cached; a request asking for prompt log-probabilities computes it anyway (and gets
    all of them), a request that does not ask hits the cache."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    prompt = PROMPTS[0]
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    run_to_end(engine)
    hits = []
    engine.subscribe(lambda e: hits.append((e.seq_id, e.num_hit_tokens)) if isinstance(e, ev.PrefixMatched) else 0)
    engine.add_request("asks", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    asks = run_to_end(engine)["asks"]
    engine.add_request("plain", prompt, SamplingParams(max_tokens=2, temperature=0))
    run_to_end(engine)
    assert hits == [("plain", 36)]                        # "asks" did not look; "plain" hit 9 blocks
    alone = run(make_engine(tiny_llama, block_size=4, num_blocks=64, enable_prefix_caching=False), [prompt],
                prompt_logprobs=0)[0]
    assert asks.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:])  # (dicts of one float each)
    assert engine.prefix_cache_stats()["num_lookup_tokens"] == 2 * len(prompt)   # "asks" is no lookup


def test_preemption_by_recompute_keeps_them(tiny_llama):
    """A pool of 12 blocks of 4 for three 37-token prompts: requests are preempted and recomputed."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=12, max_num_batched_tokens=8,
                         enable_prefix_caching=False)
    preempted = []
    engine.subscribe(lambda e: preempted.append(e.seq_id) if isinstance(e, ev.Preempted) else 0)
    prompts = [PROMPTS[0], [p + 1 for p in PROMPTS[0]], [p + 2 for p in PROMPTS[0]]]
    outs = run(engine, prompts, prompt_logprobs=1)
    assert preempted, "the pool was meant to force a preemption"
    alone = run(make_engine(tiny_llama, block_size=16, num_blocks=64), prompts, prompt_logprobs=1)
    for i in range(3):
        for a, b in zip(alone[i].prompt_logprobs[1:], outs[i].prompt_logprobs[1:]):
            assert a.keys() == b.keys() and list(b.values()) == pytest.approx(list(a.values()), abs=1e-5)


@pytest.mark.parametrize("params", [dict(n=3, temperature=1.0, seed=5), dict(beam_width=2, n=2, temperature=0)])
def test_forks_and_beams_report_the_prompts_once(tiny_llama, params):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    engine.add_request("f", PROMPTS[1], SamplingParams(max_tokens=4, prompt_logprobs=0, **params))
    out = run_to_end(engine)["f"]
    alone = run(make_engine(tiny_llama, block_size=4, num_blocks=64), [PROMPTS[1]], prompt_logprobs=0)[0]
    assert len(out.outputs) == params["n"]
    assert out.prompt_logprobs == alone.prompt_logprobs


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_values_name_the_field(value):
    with pytest.raises(FieldError) as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.field == "prompt_logprobs"
    if not isinstance(value, bool):
        with pytest.raises(FieldError) as info:
            SamplingParams(include_stop_str_in_output=value)
        assert info.value.field == "include_stop_str_in_output"


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    engine.add_request("probe", "abc", SamplingParams(max_tokens=24, temperature=0))
    text = run_to_end(engine)["probe"].outputs[0].text
    stop = text[5:8]
    for include in (False, True):
        engine.add_request("s", "abc", SamplingParams(max_tokens=24, temperature=0, stop=["\x00never", stop],
                                                      include_stop_str_in_output=include))
        streamed, final = "", None
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                streamed += out.outputs[0].delta
                final = out.outputs[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert final.finish_reason == "stop" and streamed == final.text == text[:cut]
