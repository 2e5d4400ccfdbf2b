"""Speculative decoding preserves the target distribution exactly.

Two levels:

1. The acceptance rule alone, on the counterexample p = (0.2, 0.3, 0.5),
   q = (0.5, 0.4, 0.1): drafts drawn from q and checked by `verify` must come
   out distributed as p. A wrong residual, max(0, p - q * p(x)/q(x)), is
   computed exactly and shown to give a different distribution, and the same
   statistical check that the right rule passes fails for it.
2. The whole engine: a tiny random model with an 8-token vocabulary (so the
   joint distribution of the first two generated tokens has only 64 outcomes
   and can be computed exactly), speculating with a truncated 1-layer draft.
   Thousands of seeded requests must match the exact joint probabilities, at
   temperature 1 and at temperature 0.7 with top-k 3 — and the engine with the
   seed's residual patched in must fail the same check.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from nanoserve import SamplingParams, spec_decode
from nanoserve.components import Components
from nanoserve.sampler import SamplingRow, probs

P = torch.tensor([0.2, 0.3, 0.5])
Q = torch.tensor([0.5, 0.4, 0.1])


def scaled_residual_verify(p, draft, q, greedy, generator):
    """Wrong on purpose: the residual max(0, p - q * p(x)/q(x)) (a common mistake, see lesson 2)."""
    p, q = p.cpu(), q.cpu()
    for i, x in enumerate(draft):
        ratio = float(p[i, x]) / float(q[i, x])
        if float(torch.rand((), generator=generator)) < ratio:
            continue
        residual = (p[i] - q[i] * ratio).clamp_min(0.0)
        return draft[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))], i
    return draft + [int(torch.multinomial(p[len(draft)], 1, generator=generator))], len(draft)


def first_token_distribution(rule, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(3)
    p = torch.stack([P, P])                                  # position 0 and the bonus position
    for _ in range(n):
        x = int(torch.multinomial(Q, 1, generator=g))
        tokens, _ = rule(p, [x], Q[None], False, g)
        counts[tokens[0]] += 1
    return counts / n


def exact_scaled_residual_distribution() -> torch.Tensor:
    """P(out = y) under the wrong rule: accepted x, or a rejection followed by the wrong residual."""
    out = torch.zeros(3)
    for x in range(3):
        accept = min(1.0, float(P[x] / Q[x]))
        out[x] += Q[x] * accept
        if accept < 1.0:    # only a draft that can be rejected reaches the residual
            residual = (P - Q * P[x] / Q[x]).clamp_min(0.0)
            out += Q[x] * (1 - accept) * residual / residual.sum()
    return out


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_counterexample_exact_rule_gives_p():
    assert tv(first_token_distribution(spec_decode.verify, 20_000), P) < 0.015


def test_counterexample_breaks_the_scaled_residual():
    wrong = exact_scaled_residual_distribution()
    assert tv(wrong, P) > 0.05                                # the wrong rule is far from p ...
    observed = first_token_distribution(scaled_residual_verify, 20_000)
    assert tv(observed, wrong) < 0.015                        # ... sampling agrees with that computation ...
    assert tv(observed, P) > 0.015                            # ... and the check that the right rule passes fails


# -- the whole engine ------------------------------------------------------------------------------

VOCAB = 8
NUM_REQUESTS = 12000
PROMPT = [1, 5, 2, 7, 3]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    from conftest import save_tiny

    from nanoserve.models.loader import load_model
    # initializer_range 0.3: peaked enough that the 1-layer draft often disagrees with the target
    # (acceptance about 40 %), flat enough that many outcomes have real probability.
    path = save_tiny("tiny-llama", tmp_path_factory.mktemp("v8"), with_tokenizer=False,
                     vocab_size=VOCAB, initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    return load_model(path)


def exact_joint(loaded, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2) [V, V] under plain sampling, from the target model's own logits."""
    engine = make_engine(loaded, num_blocks=64)
    runner = engine.runner
    from nanoserve.runner import RunInput

    def next_probs(tokens, output):
        table = engine.pool.allocate(engine.pool.blocks_needed(0, len(tokens)))
        logits = runner.run(runner.prepare([RunInput(tokens, 0, table)]))
        engine.pool.free(table)
        return probs(logits, [SamplingRow(params, PROMPT, output, None, None)])[0]

    p1 = next_probs(PROMPT, [])
    joint = torch.zeros(VOCAB, VOCAB)
    for t1 in range(VOCAB):
        joint[t1] = p1[t1] * next_probs(PROMPT + [t1], [t1])
    return joint


PROPOSERS = {
    "draft": dict(speculative_method="draft", num_speculative_tokens=2, draft_num_layers=1),
    # The prompt holds every token but 0, 4 and 6, so after most first tokens the n-gram
    # proposer finds an earlier occurrence and proposes what followed it (q one-hot).
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=2),
}


def sampled_joint(loaded, params: SamplingParams, proposer: str = "draft",
                  components: Components | None = None) -> tuple[torch.Tensor, float]:
    engine = make_engine(loaded, components, block_size=4, num_blocks=4096, max_num_seqs=512,
                         max_num_batched_tokens=4096, **PROPOSERS[proposer])
    for i in range(NUM_REQUESTS):
        engine.add_request(str(i), PROMPT, params.__class__(**{**_fields(params), "seed": 10_000 + i}))
    counts = torch.zeros(VOCAB, VOCAB)
    drafted = accepted = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
        for out in result.outputs:
            if out.finished:
                t = out.outputs[0].token_ids
                counts[t[0], t[1]] += 1
    assert drafted > 0, "the draft model must have proposed tokens"
    return counts / NUM_REQUESTS, accepted / drafted


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


# Only the first two tokens are counted. max_tokens=3 still verifies a draft for the second one (the
# engine drafts min(k, tokens left - 1) = 1 token after the first), and saves a fifth of the run.
SETTINGS = {
    "t1": SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
    "t0.7-top3": SamplingParams(max_tokens=3, temperature=0.7, top_k=3, ignore_eos=True),
}
TV_BOUND = 0.025  # sampling noise over 64 outcomes at N = 12000 is about 0.01; the wrong rule lands near 0.045


@pytest.mark.slow          # 12,000 requests per run: minutes
@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_engine_speculation_matches_exact_joint(small_vocab_model, name, proposer):
    params = SETTINGS[name]
    exact = exact_joint(small_vocab_model, params)
    observed, acceptance = sampled_joint(small_vocab_model, params, proposer)
    assert 0.0 < acceptance < 1.0, "both acceptances and rejections must occur for the test to mean anything"
    assert tv(observed, exact) < TV_BOUND


@pytest.mark.slow
def test_engine_with_the_scaled_residual_fails_the_same_check(small_vocab_model):
    params = SETTINGS["t1"]
    exact = exact_joint(small_vocab_model, params)
    # the engine's seam for its acceptance rule (components.py); the rest of the engine is unchanged
    observed, _ = sampled_joint(small_vocab_model, params, components=Components(verify=scaled_residual_verify))
    assert tv(observed, exact) > TV_BOUND
