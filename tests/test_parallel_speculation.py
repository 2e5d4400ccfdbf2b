"""n > 1 under speculative decoding: the n completions are independent samples.

A request with n > 1 computes its prompt once and forks when the first token is drawn: plain
sampling draws the n first tokens from the same logits row, each with its own RNG
(`token_choice.py`). With chunked prefill a prompt's last chunk can be a single token, the case
where a proposer may draft: if the first token came from draft verification, the forks'
first tokens were never drawn and all n completions began with the same token.

Here a tiny random model with an 8-token vocabulary (so the first-token distribution p is
computed exactly from the model's logits) runs the shape that reached it: block size 4,
budget 8, n-gram speculation with k = 1, a prompt of 9 tokens made of a repeated pattern
(the proposer finds it), n = 3, temperature 1. Two completions' first tokens are equal with
probability sum(p(x)^2) when they are independent; the observed rate must stay within a
few standard errors of that (with the old behaviour it was 1), and each completion's first
token must follow p.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_engine, save_tiny

from nanoserve import SamplingParams
from nanoserve.runner import RunInput
from nanoserve.sampler import SamplingRow, probs

VOCAB = 8
PROMPT = [5, 6, 7] * 3            # 9 tokens: chunks of 8 and 1 with a budget of 8
N = 3
NUM_REQUESTS = 300
# No prefix cache: a cached prompt would skip its first chunk and run whole in the step it is admitted.
SPEC = dict(block_size=4, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=N, enable_prefix_caching=False,
            speculative_method="ngram", num_speculative_tokens=1, ngram_min=1, ngram_max=2)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    from nanoserve.models.loader import load_model
    path = save_tiny("tiny-llama", tmp_path_factory.mktemp("v8n"), with_tokenizer=False,
                     vocab_size=VOCAB, initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    return load_model(path)


def first_token_probs(loaded, params: SamplingParams) -> torch.Tensor:
    """p(first token) [V] after the sampler's processing, from the model's own logits."""
    engine = make_engine(loaded, num_blocks=16)
    table = engine.pool.allocate(engine.pool.blocks_needed(0, len(PROMPT)))
    logits = engine.runner.run(engine.runner.prepare([RunInput(PROMPT, 0, table)]))
    return probs(logits, [SamplingRow(params, PROMPT, [], None, None)])[0]


def test_prompt_tail_gets_no_draft_and_all_n_fork_in_one_step(small_vocab_model):
    """The repro of the state machine: the step that gives the request its first token forks it."""
    engine = make_engine(small_vocab_model, **SPEC)
    engine.add_request("r", PROMPT, SamplingParams(n=N, temperature=1.0, max_tokens=4, seed=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        for out in result.outputs:
            with_tokens = [c for c in out.outputs if c.token_ids]
            assert not with_tokens or len(out.outputs) == N, f"step {result.stats.step}: {out.outputs}"


def test_n_completions_are_independent_under_speculation(small_vocab_model):
    params = SamplingParams(n=N, temperature=1.0, max_tokens=3, ignore_eos=True)
    p = first_token_probs(small_vocab_model, params)
    engine = make_engine(small_vocab_model, **SPEC)
    firsts, drafted, completions = [], 0, []
    for i in range(NUM_REQUESTS):          # one at a time: every prompt ends in a 1-token chunk
        engine.add_request(str(i), PROMPT, SamplingParams(n=N, temperature=1.0, max_tokens=3, ignore_eos=True,
                                                          seed=1000 + i))
        while engine.has_unfinished_requests():
            result = engine.step()
            drafted += result.stats.num_drafted
            for out in result.outputs:
                if out.finished:
                    completions.append(len(out.outputs))
                    if len(out.outputs) == N:
                        firsts.append([c.token_ids[0] for c in out.outputs])
    engine.check_invariants()
    assert drafted > 0, "the n-gram proposer must have drafted (after the first token)"
    assert len(firsts) > NUM_REQUESTS // 2
    # Pairs of completions of one request whose first tokens are equal.
    pairs = [(a[i], a[j]) for a in firsts for i in range(N) for j in range(i + 1, N)]
    equal = sum(x == y for x, y in pairs) / len(pairs)
    expected = float((p * p).sum())
    # Pairs of one request are not independent of each other; bound with one pair per request.
    sigma = math.sqrt(expected * (1 - expected) / len(firsts))
    assert abs(equal - expected) < 4 * sigma, f"first tokens equal in {equal:.3f} of pairs, expected {expected:.3f}"
    # Each completion (the request's own sequence and each fork) draws its first token from p.
    for k in range(N):
        observed = torch.bincount(torch.tensor([a[k] for a in firsts]), minlength=VOCAB).float() / len(firsts)
        assert 0.5 * float((observed - p).abs().sum()) < 0.12, f"completion {k}: {observed} vs {p}"
    assert completions == [N] * NUM_REQUESTS, "every request must end with its n completions"
