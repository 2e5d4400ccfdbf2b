"""Greedy parity with Hugging Face `generate` on the same weights.

16 prompts of mixed lengths go in together; the engine must produce exactly
HF's greedy tokens for each, whatever the block size, with a token budget that
splits prompts into chunks, with chunked prefill off, and with a pool so small
that requests get preempted and recomputed, with the runner's speed paths on
and off. Invariants hold after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE, make_engine
from transformers import AutoModelForCausalLM

from nanoserve import SamplingParams

NUM_PROMPTS = 16
MAX_TOKENS = 12


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 7, 8, 13, 16, 17, 24, 31, 33, 40, 47, 60, 71]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths[:NUM_PROMPTS]]


def hf_greedy(model_dir: str, prompt_list, max_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompt_list:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def engine_greedy(loaded, prompt_list, max_tokens, **config):
    engine = make_engine(loaded, **config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompt_list):
        engine.add_request(str(i), p, params)
    preempted = 0
    finished = {}
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        preempted += result.stats.num_preempted
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    engine.check_invariants()
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompt_list))], preempted


CONFIGS = {
    # name: (engine config, must preempt)
    "bs1-chunked": (dict(block_size=1, num_blocks=2048, max_num_batched_tokens=24), False),
    "bs4-chunked": (dict(block_size=4, num_blocks=512, max_num_batched_tokens=16), False),
    "bs16-chunked": (dict(block_size=16, num_blocks=128, max_num_batched_tokens=32), False),
    "bs16-no-chunking": (dict(block_size=16, num_blocks=128, max_num_batched_tokens=128,
                              enable_chunked_prefill=False), False),
    "bs4-preempt": (dict(block_size=4, num_blocks=40, max_num_batched_tokens=32), True),
    "bs16-preempt-no-chunking": (dict(block_size=16, num_blocks=12, max_num_batched_tokens=96,
                                      enable_chunked_prefill=False), True),
}


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny_gpt2_dir):
    cache = {}
    def get(kind):
        if kind not in cache:
            model_dir = tiny_llama_dir if kind == "llama" else tiny_gpt2_dir
            cache[kind] = hf_greedy(model_dir, prompts(257), MAX_TOKENS)
        return cache[kind]
    return get


@pytest.mark.parametrize("path", ["fast", "reading"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(kind, name, path, expected, tiny_llama, tiny_gpt2):
    """Every config on the fast and the reading path (implementation.py): the same tokens as HF."""
    loaded = tiny_llama if kind == "llama" else tiny_gpt2
    config, must_preempt = CONFIGS[name]
    got, preempted = engine_greedy(loaded, prompts(257), MAX_TOKENS, path=path, **config)
    assert got == expected(kind)
    if must_preempt:
        assert preempted > 0, "the pool was meant to be small enough to force preemption"


def test_llama3_style_rope_scaling_and_tied_embeddings(tmp_path):
    """A Llama-3-style config: llama3 RoPE scaling, large theta, tied embeddings, GQA 4:1."""
    from transformers import LlamaConfig

    from nanoserve.models.loader import load_model

    config = LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    prompt_list = prompts(257)[8:]          # the longer prompts: positions past the original 32
    want = hf_greedy(str(tmp_path), prompt_list, MAX_TOKENS)
    got, _ = engine_greedy(load_model(str(tmp_path), device=DEVICE), prompt_list, MAX_TOKENS, block_size=8,
                           num_blocks=256,
                           max_num_batched_tokens=32)
    assert got == want


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_prefix_cache_hits_give_hf_tokens(kind, tiny_llama, tiny_gpt2, tiny_llama_dir, tiny_gpt2_dir):
    """Prompts sharing a 37-token prefix, in two waves: the second wave's prefills skip the cached blocks
    (chunked, with preemption in a small pool) and still give HF's tokens."""
    from nanoserve import events as ev

    loaded, model_dir = (tiny_llama, tiny_llama_dir) if kind == "llama" else (tiny_gpt2, tiny_gpt2_dir)
    rng = random.Random(3)
    shared = [rng.randrange(257) for _ in range(37)]
    waves = [[shared + [rng.randrange(257) for _ in range(n)] for n in lens] for lens in ([1, 9], [4, 2, 15, 6])]
    engine = make_engine(loaded, block_size=4, num_blocks=24, max_num_batched_tokens=24)
    hits, preempted = [], 0
    engine.subscribe(lambda e: hits.append(e.num_hit_tokens) if isinstance(e, ev.PrefixMatched) else None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    got = {}
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            engine.add_request(f"{w}.{i}", p, params)
        while engine.has_unfinished_requests():
            result = engine.step()
            engine.check_invariants()
            preempted += result.stats.num_preempted
            got.update({o.request_id: o.outputs[0].token_ids for o in result.outputs if o.finished})
    want = hf_greedy(model_dir, [p for wave in waves for p in wave], MAX_TOKENS)
    assert [got[f"{w}.{i}"] for w, wave in enumerate(waves) for i in range(len(wave))] == want
    assert sum(h >= 36 for h in hits) >= 4, f"the second wave was meant to hit the cached prefix: {hits}"
    assert preempted > 0, "the pool was meant to be small enough to force preemption"
