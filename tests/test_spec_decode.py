"""Speculative decoding: greedy outputs unchanged, exact acceptance rule, rollback, bad input.

The distribution tests (sampling at temperature 1 and 0.7 with top-k) live in
test_spec_distribution.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine
from test_parity import CONFIGS, engine_greedy, prompts

from nanoserve import EngineConfig, SamplingParams
from nanoserve import events as ev
from nanoserve.spec_decode import ngram_lookup, verify

MAX_TOKENS = 12


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves, so the n-gram proposer finds matches to propose."""
    base = prompts(vocab)
    return [(p * 3)[: min(100, max(3, 2 * len(p)))] for p in base]


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_gpt2):
    cache = {}
    def get(kind, prompt_list_name):
        key = (kind, prompt_list_name)
        if key not in cache:
            loaded = tiny_llama if kind == "llama" else tiny_gpt2
            plist = repetitive_prompts(257) if prompt_list_name == "rep" else prompts(257)
            cache[key] = engine_greedy(loaded, plist, MAX_TOKENS, block_size=16, num_blocks=256,
                                       max_num_batched_tokens=512)[0]
        return cache[key]
    return get


SPEC = {
    "ngram-k4": dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
    "ngram-k1": dict(speculative_method="ngram", num_speculative_tokens=1, ngram_min=2, ngram_max=2),
    "draft-k3": dict(speculative_method="draft", num_speculative_tokens=3, draft_num_layers=1),
}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("name", ["bs4-chunked", "bs4-preempt", "bs16-no-chunking"])
def test_greedy_unchanged_by_speculation(kind, spec, name, reference, tiny_llama, tiny_gpt2):
    loaded = tiny_llama if kind == "llama" else tiny_gpt2
    config, must_preempt = CONFIGS[name]
    got, preempted = engine_greedy(loaded, repetitive_prompts(257), MAX_TOKENS, **config, **SPEC[spec])
    assert got == reference(kind, "rep")
    if must_preempt:
        assert preempted > 0


def test_speculation_really_happens(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=256, **SPEC["ngram-k4"])
    for i, p in enumerate(repetitive_prompts(257)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    proposed = verified = trimmed = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        for e in result.events:
            proposed += isinstance(e, ev.DraftProposed)
            verified += isinstance(e, ev.DraftVerified)
            trimmed += isinstance(e, ev.KVTrimmed) and e.num_tokens_dropped > 0
    assert proposed > 0 and verified > 0 and trimmed > 0
    engine.clear_prefix_cache()
    assert engine.pool.num_used_blocks == 0


def test_draft_model_pool_is_released(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=16, **SPEC["draft-k3"])
    for i, p in enumerate(prompts(257)[:6]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=10, temperature=0.8, seed=i))
    engine.step(); engine.step()
    engine.abort_request("0")
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert engine.proposer.pool.num_used_blocks == 0 and not engine.proposer.states


def test_stop_and_max_tokens_with_several_tokens_per_step(tiny_llama):
    """Drafts never overshoot max_tokens, and a stop token inside an accepted run ends the request there."""
    plain = make_engine(tiny_llama, num_blocks=128)
    p = repetitive_prompts(257)[10]
    plain.add_request("x", p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    tokens = []
    while plain.has_unfinished_requests():
        for o in plain.step().outputs:
            tokens = o.outputs[0].token_ids
    stop = tokens[6]
    for max_tokens in (1, 2, 5):
        engine = make_engine(tiny_llama, num_blocks=128, **SPEC["ngram-k4"])
        engine.add_request("x", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        engine.add_request("s", p, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop]))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step().outputs})
        assert outs["x"].outputs[0].token_ids == tokens[:max_tokens]
        assert outs["s"].outputs[0].token_ids == tokens[: tokens.index(stop) + 1]


# -- the acceptance rule on its own ----------------------------------------------------------------


def test_verify_greedy_accepts_while_draft_is_argmax():
    p = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.2, 0.6]])
    assert verify(p, [1, 0], None, greedy=True, generator=None) == ([1, 0, 2], 2)   # all + bonus
    assert verify(p, [1, 2], None, greedy=True, generator=None) == ([1, 0], 1)      # corrected at 1
    assert verify(p, [0, 0], None, greedy=True, generator=None) == ([1], 0)


def test_verify_never_emits_a_token_the_target_forbids():
    # p forbids token 0; a draft of 0 must always be rejected and the residual can't give 0 either.
    p = torch.tensor([[0.0, 0.5, 0.5], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.9, 0.05, 0.05]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens, accepted = verify(p, [0], q, greedy=False, generator=g)
        assert accepted == 0 and tokens[0] != 0


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1]          # longest suffix [1,2,3] at 0
    assert ngram_lookup([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 3) == [8, 5, 6]    # latest earlier [5,6] wins
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 4) == []                       # no repeat
    assert ngram_lookup([1, 2, 1, 2], 2, 2, 0) == []


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", ngram_min=4, ngram_max=2), "ngram_min <= ngram_max"),
    (dict(speculative_method="ngram", ngram_min=0), "ngram_min"),
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(speculative_method="draft", draft_num_layers=0), "draft_num_layers"),
])
def test_bad_speculative_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="tiny-llama", **kwargs)


def test_draft_with_other_vocabulary_is_rejected(tiny_llama, tmp_path):
    from conftest import save_tiny
    other = save_tiny("tiny-llama", tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(tiny_llama, speculative_method="draft", draft_model=other)


def test_truncated_draft_too_deep_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="draft_num_layers"):
        make_engine(tiny_llama, speculative_method="draft", draft_num_layers=5)


def test_draft_cut_by_the_token_budget_rolls_back_correctly(tiny_llama):
    """Regression: a draft the budget cut to nothing must roll the draft cache back to the
    token count it was proposed at, not the count after this step's token."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=5,
                         speculative_method="draft", num_speculative_tokens=3, draft_num_layers=1)
    plain = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=5)
    outs = []
    for e in (engine, plain):
        for rid in ("a", "b"):
            e.add_request(rid, [10, 20, 30, 40, 50], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        done = {}
        while e.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in e.step().outputs if o.finished})
            e.check_invariants()
        outs.append(done)
    assert outs[0] == outs[1]


def test_spec_stats_overall_and_per_request(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=128, **SPEC["ngram-k4"])
    for i, p in enumerate(repetitive_prompts(257)[8:12]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    outs = {}
    drafted = accepted = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
        outs.update({o.request_id: o for o in result.outputs if o.finished})
    stats = engine.spec_stats()
    assert stats["num_drafted"] == drafted == sum(o.metrics.num_drafted for o in outs.values())
    assert stats["num_accepted"] == accepted == sum(o.metrics.num_accepted for o in outs.values())
    steps = sum(o.metrics.num_sampling_steps for o in outs.values())
    assert stats["tokens_per_forward"] == pytest.approx(40 / steps)
    assert stats["tokens_per_forward"] > 1
    for o in outs.values():
        assert o.tokens_per_forward == pytest.approx(10 / o.metrics.num_sampling_steps)
