"""Sampler tests: exact hand computations for each step, distributions by counting."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    probs,
    process_logits,
)
from nanoserve.sampling_params import SamplingParams

# Six tokens whose softmax is exactly these probabilities (up to float rounding).
P6 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
LOGITS6 = P6.log()


def row(prompt=(), output=(), seed=None, eos=None, **kw) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen, eos)


def renorm(values, keep):
    kept = torch.tensor([v if i in keep else 0.0 for i, v in enumerate(values)])
    return kept / kept.sum()


# ---------------------------------------------------------------- greedy and penalties

def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(8)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    p = probs(logits, [row(temperature=0.0) for _ in range(8)])
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    prompt, output = [0, 1], [3, 3, 4]
    # repetition only: seen = {0, 1, 3, 4}; positive / 2, negative * 2
    rep = apply_penalties(logits, [row(prompt, output, repetition_penalty=2.0)])
    assert torch.allclose(rep, torch.tensor([[1.0, -2.0, 0.5, 1.5, -4.0, 0.0]]))
    # presence/frequency only look at the output: token 3 twice, token 4 once
    pf = apply_penalties(logits, [row(prompt, output, presence_penalty=0.5, frequency_penalty=0.25)])
    assert torch.allclose(pf, torch.tensor([[2.0, -1.0, 0.5, 3.0 - 0.5 - 0.5, -2.0 - 0.5 - 0.25, 0.0]]))
    # all three: repetition first, then subtraction
    both = apply_penalties(logits, [row(prompt, output, repetition_penalty=2.0,
                                        presence_penalty=0.5, frequency_penalty=0.25)])
    assert torch.allclose(both, torch.tensor([[1.0, -2.0, 0.5, 0.5, -4.75, 0.0]]))


def test_penalties_are_per_row():
    torch.manual_seed(1)
    logits = torch.randn(3, 10)
    rows = [row([1, 2], [3, 3], repetition_penalty=1.3), row(),
            row([], [5, 5, 5, 7], presence_penalty=-1.0, frequency_penalty=0.7)]
    together = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        assert torch.allclose(together[i], apply_penalties(logits[i:i + 1], [r])[0])
    assert torch.equal(together[1], logits[1])


# ---------------------------------------------------------------- min_tokens

@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = torch.zeros(1, 8)
    for n_out in range(4):
        r = row(output=[0] * n_out, eos=7, min_tokens=3, stop_token_ids=[2, 5], ignore_eos=ignore_eos)
        masked = apply_min_tokens(logits, [r])[0]
        expect_masked = n_out < 3
        for tok in range(8):
            assert math.isinf(masked[tok]) == (expect_masked and tok in (2, 5, 7))


def test_min_tokens_without_eos_masks_only_stop_ids():
    masked = apply_min_tokens(torch.zeros(1, 4), [row(min_tokens=2, stop_token_ids=[1])])[0]
    assert masked.tolist() == [0.0, float("-inf"), 0.0, 0.0]
    # and the sampler never picks a masked token, even when it is the argmax
    logits = torch.tensor([[0.0, 0.0, 0.0, 10.0]])
    out = Sampler()(logits, [row(eos=3, min_tokens=1, temperature=0.0)])
    assert out[0].token_id != 3


# ---------------------------------------------------------------- top-k / top-p / min-p

@pytest.mark.parametrize("kw, expected", [
    (dict(), P6),
    (dict(top_k=3), renorm(P6, {0, 1, 2})),
    (dict(top_k=-1), P6),
    (dict(top_k=100), P6),
    (dict(top_p=0.5), renorm(P6, {0, 1})),          # mass before: 0, .30, .55 -> third crosses .5 already
    (dict(top_p=0.52), renorm(P6, {0, 1})),         # second token crosses .52 and is kept
    (dict(top_p=0.01), renorm(P6, {0})),            # always at least one
    (dict(min_p=0.5), renorm(P6, {0, 1, 2})),       # threshold .15
    (dict(min_p=0.3), renorm(P6, {0, 1, 2, 3})),    # threshold .09
    # top-p runs on what top-k left, renormalised: .3448 .2874 .2299 .1379 -> mass before 3rd .632 < .8, 4th .862
    (dict(top_k=4, top_p=0.8), renorm(P6, {0, 1, 2})),
    # temperature .5 squares the probabilities: .09 .0625 .04 ... ; min_p .5 keeps >= .045
    (dict(temperature=0.5, min_p=0.5), renorm(P6 ** 2, {0, 1})),
    (dict(temperature=0.5), P6 ** 2 / (P6 ** 2).sum()),
])
def test_probs_match_hand_computation(kw, expected):
    p = probs(LOGITS6.unsqueeze(0), [row(**kw)])[0]
    assert torch.allclose(p, expected, atol=1e-6), (p, expected)


def test_probs_rows_are_independent_of_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    rows = [row(top_k=5), row(temperature=0.0), row(top_p=0.7, temperature=0.8), row(min_p=0.2)]
    together = probs(logits, rows)
    for i, r in enumerate(rows):
        assert torch.allclose(together[i], probs(logits[i:i + 1], [r])[0])


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.integers(-1, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    seed=st.integers(0, 10_000),
)
def test_probs_invariants(temperature, top_k, top_p, min_p, seed):
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(seed)) * 3
    r = row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    p = probs(logits, [r])[0]
    assert torch.isclose(p.sum(), torch.tensor(1.0), atol=1e-5)
    assert (p >= 0).all()
    support = p > 0
    assert p[logits[0].argmax()] > 0               # the most likely token always survives
    if top_k > 0 and temperature > 0:
        assert int(support.sum()) <= top_k
    # the support is a "top" set: nothing kept is less likely than something dropped
    if not support.all():
        assert logits[0][support].min() > logits[0][~support].max()


# ---------------------------------------------------------------- distribution

def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    expected = expected_p * n
    live = expected > 0
    assert counts[~live].sum() == 0, "sampled a token with probability 0"
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=3)])
@pytest.mark.parametrize("seeded", [False, True])
def test_samples_follow_probs(kw, seeded):
    N = 20_000
    logits = torch.tensor([1.0, 0.5, 0.2, -0.3, -1.0]).expand(N, 5)
    torch.manual_seed(3)
    rows = [row(seed=i if seeded else None, **kw) for i in range(N)]
    target = probs(logits[:1], rows[:1])[0]
    tokens = torch.tensor([t.token_id for t in Sampler()(logits, rows)])
    counts = torch.bincount(tokens, minlength=5).float()
    tvd = 0.5 * (counts / N - target).abs().sum()
    assert tvd < 0.02, (counts / N, target)
    # df <= 4; P(chi2_4 > 30) is about 5e-6, so this only fails on a real bias
    assert chi_square(counts, target) < 30.0


# ---------------------------------------------------------------- seeds

def test_seed_reproducible_whatever_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(6, 40)
    alone = [Sampler()(logits[2:3], [row(seed=1234)])[0].token_id for _ in range(3)]
    assert len(set(alone)) == 1                     # fresh generator, same seed, same token
    for trial in range(5):
        rows = [row(seed=100 + trial), row(), row(seed=1234), row(temperature=0.0),
                row(seed=7, top_k=3), row(top_p=0.5)]
        assert Sampler()(logits, rows)[2].token_id == alone[0]
    # and a seeded sequence of draws does not depend on the neighbours either
    g_alone, g_batch = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for step in range(10):
        a = Sampler()(logits[:1], [SamplingRow(SamplingParams(), [], [], g_alone, None)])[0]
        rows = [SamplingRow(SamplingParams(), [], [], g_batch, None), row(seed=step), row()]
        b = Sampler()(logits[[0, 1, 3]], rows)[0]
        assert a.token_id == b.token_id


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    tokens = {Sampler()(logits, [row(seed=s)])[0].token_id for s in range(20)}
    assert len(tokens) > 10


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_raw():
    torch.manual_seed(5)
    logits = torch.randn(4, 20)
    rows = [row(output=[1, 2], repetition_penalty=1.5, temperature=0.6, logprobs=3, seed=0),
            row(top_k=2, logprobs=0), row(temperature=0.0, presence_penalty=2.0, output=[0]),
            row(min_p=0.3, logprobs=25)]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(-1)
    for i, t in enumerate(out):
        assert isinstance(t, SampledToken)
        assert t.logprob == pytest.approx(raw[i, t.token_id].item(), abs=1e-6)
    assert out[2].top_logprobs is None
    assert out[1].top_logprobs == {out[1].token_id: out[1].logprob}
    assert len(out[3].top_logprobs) == 20           # capped at the vocabulary
    top3 = raw[0].topk(3)
    expect = dict(zip(top3.indices.tolist(), top3.values.tolist()))
    for tok, lp in out[0].top_logprobs.items():
        assert lp == pytest.approx(raw[0, tok].item(), abs=1e-6)
    assert set(expect) <= set(out[0].top_logprobs)
    assert out[0].token_id in out[0].top_logprobs
    assert len(out[0].top_logprobs) == 3 + (out[0].token_id not in expect)


def test_top_logprobs_include_chosen_token_outside_top():
    # Penalties push greedy away from tokens 0 and 1, which stay the raw top-2.
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    out = Sampler()(logits, [row(output=[0, 1], presence_penalty=2.0, repetition_penalty=10.0,
                                 temperature=0.0, logprobs=2)])[0]
    assert out.token_id == 2
    assert set(out.top_logprobs) == {0, 1, 2}


# ---------------------------------------------------------------- no side effects

def test_caller_logits_untouched():
    torch.manual_seed(6)
    logits = torch.randn(3, 16)
    before = logits.clone()
    rows = [row([1, 2], [3, 4], eos=5, min_tokens=4, repetition_penalty=1.2, presence_penalty=0.3,
                 frequency_penalty=0.3, top_k=4, top_p=0.9, min_p=0.1, temperature=0.7, logprobs=2),
            row(temperature=0.0, min_tokens=1, stop_token_ids=[0], eos=1), row(seed=3)]
    Sampler()(logits, rows)
    probs(logits, rows)
    process_logits(logits, rows)
    assert torch.equal(logits, before)


def test_empty_batch():
    assert Sampler()(torch.zeros(0, 5), []) == []
