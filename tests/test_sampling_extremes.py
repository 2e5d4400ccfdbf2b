"""Every setting validation lets through gives the sampler a distribution to draw from.

Found by the server's schemathesis fuzz: `"repetition_penalty": 5e-324` is > 0, so it is valid,
but it is 0 in float32, and positive logits divided by it were +inf: softmax gave NaN and the
whole step failed (every request in it). The same for a temperature of 5e-324 (or 1e-30: logits
/ T overflow), a huge penalty (0 * inf is NaN for a logit of exactly 0) and a top_p that is 0 in
float32 (everything dropped). Each is now the limit it tends to: a tiny temperature is the
argmax, a tiny penalty makes a seen token as likely as float32 allows.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.sampler import SamplingRow, probs

EXTREMES = [
    dict(repetition_penalty=5e-324), dict(repetition_penalty=1e-40), dict(repetition_penalty=1e308),
    dict(temperature=5e-324), dict(temperature=1e-30), dict(top_p=1e-300), dict(top_p=1e-45),
    dict(temperature=5e-324, repetition_penalty=5e-324, top_p=1e-300, min_p=1.0, top_k=1),
    dict(temperature=2.0, frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=1e-30),
]


@pytest.mark.parametrize("settings", EXTREMES, ids=str)
def test_the_distribution_is_a_distribution(settings):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 10
    logits[0, 7] = 0.0                                   # a logit of exactly 0 (0 * inf is NaN)
    logits[1, :10] = float("-inf")                       # masked tokens are allowed
    rows = [SamplingRow(SamplingParams(**settings), [1, 2, 3, 7], [4, 7], None, None) for _ in range(3)]
    p = probs(logits, rows)
    assert torch.isfinite(p).all() and (p >= 0).all()
    assert torch.allclose(p.sum(-1), torch.ones(3))
    assert (p[1, :10] == 0).all()                        # a masked token stays impossible


def test_a_tiny_temperature_is_the_argmax():
    logits = torch.randn(4, 50) * 5
    rows = [SamplingRow(SamplingParams(temperature=t), [1], [], None, None) for t in (5e-324, 1e-30, 1e-20, 1e-9)]
    p = probs(logits, rows)
    assert torch.equal(p.argmax(-1), logits.argmax(-1)) and torch.allclose(p.max(-1).values, torch.ones(4))


def test_the_engine_runs_every_extreme_with_a_neighbour():
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64))
    for i, settings in enumerate(EXTREMES):
        engine.add_request(f"x{i}", "Wow wow", SamplingParams(max_tokens=5, seed=i, **settings))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=5, temperature=0))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:            # (a StepFailed would raise here)
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert len(done) == len(EXTREMES) + 1
    assert all(c.finish_reason == "length" and c.error is None for c in done.values())
