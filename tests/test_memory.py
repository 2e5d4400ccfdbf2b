"""Memory mechanisms against Hugging Face and against themselves: the radix prefix cache,
copy-on-write fork (n > 1, engine.fork), beam search and swap preemption.

Every mechanism can be switched off, and greedy outputs must not change when it is:
all runs below are compared with HF `generate` on the same weights, and
`check_invariants()` runs after every step (`run_to_end`).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_engine, run_to_end
from test_parity import hf_greedy
from transformers import AutoModelForCausalLM

from nanoserve import SamplingParams
from nanoserve import events as ev

MAX_TOKENS = 10


def shared_prompts(vocab: int = 257) -> list[list[int]]:
    """Twelve prompts over three system prompts (lengths 21, 37, 8) with short unique tails."""
    rng = random.Random(7)
    systems = [[rng.randrange(vocab) for _ in range(n)] for n in (21, 37, 8)]
    return [systems[i % 3] + [rng.randrange(vocab) for _ in range(1 + (5 * i) % 9)] for i in range(12)]


@pytest.fixture(scope="module")
def hf_expected(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, shared_prompts(), MAX_TOKENS)


def greedy_run(loaded, prompts, arrivals_per_step=3, **config):
    """Prompts arrive a few per step (so later ones can hit what earlier ones cached)."""
    engine = make_engine(loaded, **config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    pending = list(enumerate(prompts))
    finished, counts = {}, {"prefill": 0, "hit": 0, "preempted": 0, "evicted": 0, "swapped_in": 0}
    while pending or engine.has_unfinished_requests():
        for i, p in pending[:arrivals_per_step]:
            engine.add_request(str(i), p, params)
        pending = pending[arrivals_per_step:]
        result = engine.step()
        engine.check_invariants()
        counts["prefill"] += result.stats.num_prefill_tokens
        counts["preempted"] += result.stats.num_preempted
        for e in result.events:
            counts["hit"] += e.num_hit_tokens if isinstance(e, ev.PrefixMatched) else 0
            counts["evicted"] += isinstance(e, ev.RadixEvicted)
            counts["swapped_in"] += isinstance(e, ev.SwappedIn)
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    engine.check_invariants()
    cached = engine.radix.num_cached_blocks if engine.radix else 0
    assert engine.pool.num_used_blocks == cached          # nothing leaks: only the cache holds blocks
    engine.clear_prefix_cache()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))], counts


MEMORY_CONFIGS = {
    # name: (config, what must happen)
    "cache-off": (dict(block_size=4, num_blocks=256, enable_prefix_caching=False), set()),
    "cache-on": (dict(block_size=4, num_blocks=256), {"hit"}),
    "cache-on-bs1": (dict(block_size=1, num_blocks=1024, max_num_batched_tokens=24), {"hit"}),
    "cache-pressure-recompute": (dict(block_size=4, num_blocks=26, max_num_batched_tokens=32), {"hit", "evicted", "preempted"}),
    "cache-pressure-swap": (dict(block_size=4, num_blocks=26, max_num_batched_tokens=32, preemption_mode="swap"),
                            {"hit", "evicted", "swapped_in"}),
    "no-cache-swap": (dict(block_size=4, num_blocks=26, max_num_batched_tokens=32, preemption_mode="swap",
                           enable_prefix_caching=False), {"swapped_in"}),
    "swap-small-cpu-pool": (dict(block_size=4, num_blocks=26, max_num_batched_tokens=32, preemption_mode="swap",
                                 num_cpu_blocks=4), {"preempted"}),
    "priority-policy": (dict(block_size=4, num_blocks=26, max_num_batched_tokens=32,
                             preemption_policy="shortest_remaining"), {"preempted"}),
}


@pytest.mark.parametrize("name", list(MEMORY_CONFIGS))
def test_greedy_matches_hf_with_every_memory_mechanism(name, hf_expected, tiny_llama):
    config, must = MEMORY_CONFIGS[name]
    got, counts = greedy_run(tiny_llama, shared_prompts(), **config)
    assert got == hf_expected
    for what in must:
        assert counts[what] > 0, f"{name}: expected some {what}, got {counts}"


def test_a_cache_hit_really_skips_prefill(tiny_llama):
    """The same prompt twice: the second computes only what is past the cached blocks."""
    prompt = list(range(1, 42))          # 41 tokens: 10 full blocks of 4 and one more token
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = run_to_end(engine)["a"].outputs[0].token_ids
    engine.add_request("b", prompt, params)
    result = engine.step()
    hit = next(e for e in result.events if isinstance(e, ev.PrefixMatched))
    assert hit.num_hit_tokens == 40 and len(hit.block_ids) == 10
    assert result.stats.num_prefill_tokens == 1            # only the last prompt token is computed
    assert run_to_end(engine)["b"].outputs[0].token_ids == first
    # A prompt of exactly 40 tokens: the match is capped so one token is still computed.
    engine.add_request("c", prompt[:40], params)
    result = engine.step()
    hit = next(e for e in result.events if isinstance(e, ev.PrefixMatched))
    assert hit.num_hit_tokens == 36 and result.stats.num_prefill_tokens == 4
    run_to_end(engine)


def test_blocks_are_cached_as_they_fill_so_concurrent_requests_share(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    prefix = list(range(1, 33))                                   # 8 blocks
    engine.add_request("first", prefix + [50], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()                                                 # 16 of its prompt tokens computed
    inserted = sum(len(n.block_ids) for n in engine.radix.nodes.values())
    assert inserted == 4                                          # already in the tree, still running
    for _ in range(2):
        engine.step()
    engine.add_request("second", prefix + [60], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    result = engine.step()
    hit = next(e for e in result.events if isinstance(e, ev.PrefixMatched))
    assert hit.num_hit_tokens == 32                               # all of "first"'s prefix, while it runs
    first = engine.sequences["first"]
    assert engine.sequences["second"].block_table[:8] == first.block_table[:8]
    assert all(engine.pool.blocks[b].ref_count == 3 for b in first.block_table[:8])   # 2 tables + the tree
    run_to_end(engine)


def test_lru_eviction_frees_least_recently_used_leaves_first(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, rid in enumerate(["old", "mid", "new"]):
        engine.add_request(rid, [100 + i] * 9, params)            # 2 full blocks each, distinct
        run_to_end(engine)
    radix = engine.radix
    by_first = {n.tokens[0]: n for n in radix.nodes.values() if n.tokens}
    assert radix.num_evictable_blocks == 6
    radix.evict(1)                                                # a whole leaf goes: the oldest
    assert 100 not in by_first or by_first[100].node_id not in radix.nodes
    assert {n.tokens[0] for n in radix.nodes.values() if n.tokens} == {101, 102}
    engine.add_request("again", [101] * 9, params)                 # touching "mid" makes "new" the oldest
    run_to_end(engine)
    radix.evict(1)
    assert {n.tokens[0] for n in radix.nodes.values() if n.tokens} == {101}
    assert engine.clear_prefix_cache() == 2 and engine.pool.num_free_blocks == 64


def test_partial_match_splits_a_node(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(1, 18)), params)            # 4 full blocks in one node
    run_to_end(engine)
    assert len(engine.radix.nodes) == 2
    engine.add_request("b", list(range(1, 9)) + [99] * 9, params)  # agrees on 2 blocks only
    events = run_to_end_events(engine)
    split = next(e for e in events if isinstance(e, ev.RadixSplit))
    assert split.num_blocks == 2
    root_children = list(engine.radix.root.children.values())
    assert len(root_children) == 1 and len(root_children[0].block_ids) == 2
    assert len(root_children[0].children) == 2                     # a's tail and b's own blocks


def run_to_end_events(engine):
    events = []
    while engine.has_unfinished_requests():
        events += engine.step().events
        engine.check_invariants()
    return events


def test_speculative_drafts_never_enter_the_cache(tiny_llama):
    """Every cached path is a prefix of some request's final tokens: no rejected draft is in the tree."""
    engine = make_engine(tiny_llama, block_size=2, num_blocks=256, speculative_method="ngram",
                         num_speculative_tokens=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(8) for _ in range(12)] * 2 for _ in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True))
    finals = {}
    rejected = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        rejected += sum(e.num_drafted - e.num_accepted for e in result.events if isinstance(e, ev.DraftVerified))
        for o in result.outputs:
            if o.finished:
                finals[o.request_id] = o.prompt_token_ids + o.outputs[0].token_ids
    assert rejected > 0
    for node in engine.radix.nodes.values():
        path = [t for n in reversed(node.path()) for t in n.tokens]
        assert any(f[: len(path)] == path for f in finals.values()), f"cached tokens {path} were never final"


# -- copy-on-write fork: n > 1 and engine.fork ----------------------------------------------------


def test_n4_greedy_gives_four_equal_completions_with_fewer_blocks(tiny_llama, tiny_llama_dir):
    prompt = list(range(3, 25))                     # 22 tokens: 5 full blocks + a partial one
    params = SamplingParams(n=4, max_tokens=8, temperature=0, ignore_eos=True)
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, enable_prefix_caching=False)
    engine.add_request("p", prompt, params)
    peak, cows = 0, []
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        snap = engine.snapshot()
        peak = max(peak, sum(1 for r in snap["pool"]["ref_counts"] if r > 0))
        cows += [e for e in result.events if isinstance(e, ev.CowCopied)]
        done = [o for o in result.outputs if o.finished]
    completions = [c.token_ids for c in done[0].outputs]
    assert len(completions) == 4 and all(c == completions[0] for c in completions)
    assert completions[0] == hf_greedy(tiny_llama_dir, [prompt], 8)[0]
    # The shared partial block (tokens 20-21) is copied by three of the four writers.
    assert len(cows) == 3 and len({e.src for e in cows}) == 1
    separate = make_engine(tiny_llama, block_size=4, num_blocks=64, enable_prefix_caching=False)
    for i in range(4):
        separate.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    peak_separate = 0
    while separate.has_unfinished_requests():
        separate.step()
        peak_separate = max(peak_separate, separate.pool.num_used_blocks)
    assert peak < peak_separate, (peak, peak_separate)
    # (measured after each step: a finishing sequence has already freed its blocks)
    assert peak == 5 + 4 * 2 and peak_separate == 4 * 7   # 5 shared prompt blocks + 2 own per sequence


def test_n_sampled_completions_are_reproducible_and_differ(tiny_llama):
    def run():
        engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
        engine.add_request("p", list(range(3, 20)), SamplingParams(n=3, max_tokens=12, seed=5, ignore_eos=True))
        return [c.token_ids for c in run_to_end(engine)["p"].outputs]
    a, b = run(), run()
    assert a == b and len({tuple(c) for c in a}) == 3


def test_fork_shares_blocks_and_continues_like_the_parent(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    engine.add_request("r", list(range(3, 17)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for _ in range(2):
        engine.step()                 # 15 tokens have KV: the last block is partly filled
    parent = engine.sequences["r"]
    child_id = engine.fork("r")
    child = engine.sequences[child_id]
    assert child_id == "r.1" and child.block_table == parent.block_table
    events = run_to_end_events(engine)
    fork_events = [e for e in events if isinstance(e, ev.CowCopied)]
    assert fork_events, "the shared partial block must be copied on the first write"
    out = [e for e in events if isinstance(e, ev.SequenceFinished)]
    assert {e.seq_id for e in out} == {"r", "r.1"}


def test_bad_forks_and_bad_params_change_nothing(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="n must be at least 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="temperature=0.7"):
        SamplingParams(beam_width=2, temperature=0.7)
    with pytest.raises(ValueError, match="top_k=5"):
        SamplingParams(beam_width=2, temperature=0, top_k=5)
    with pytest.raises(ValueError, match="at most beam_width"):
        SamplingParams(beam_width=2, temperature=0, n=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("x", [1, 2, 3], SamplingParams(n=3))
    engine.add_request("r", list(range(3, 9)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    before = engine.snapshot()
    with pytest.raises(ValueError, match="running"):
        engine.fork("r")                                   # still waiting
    with pytest.raises(KeyError, match="no unfinished request"):
        engine.fork("nope")
    assert engine.snapshot() == before
    run_to_end(engine)
    before = engine.snapshot()
    with pytest.raises(KeyError, match="already finished"):
        engine.fork("r")
    assert engine.snapshot() == before


# -- beam search -------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_hf(width, tiny_llama, tiny_llama_dir):
    """Same lengths (EOS masked until max_tokens, as HF's min_new_tokens does), length_penalty 1."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(11)
    prompts = [[rng.randrange(257) for _ in range(n)] for n in (5, 13, 22)]
    engine = make_engine(tiny_llama, block_size=4, num_blocks=256)
    params = SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=8, min_tokens=8)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    pruned = 0
    finished = {}
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        pruned += sum(isinstance(e, ev.BeamPruned) for e in result.events)
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                              do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
        expected = [row[len(p):].tolist() for row in gen.sequences]
        got = finished[str(i)].outputs
        assert [c.token_ids for c in got] == expected
        # HF's sequences_scores are sum of log-probs / length ** length_penalty (length 8 here).
        assert [c.cumulative_logprob / 8 for c in got] == pytest.approx(gen.sequences_scores.tolist(), abs=1e-4)
    assert pruned > 0, "beams should have been pruned along the way"
    engine.clear_prefix_cache()
    assert engine.pool.num_used_blocks == 0


def test_a_request_stopping_inside_an_accepted_draft_run_caches_only_its_tokens(tiny_llama):
    """Spec decoding accepts several tokens at once; a stop token among them ends the request
    with KV computed past its last kept token. Only the kept tokens may enter the cache."""
    # The "draft" is the whole target (both layers): greedy accepts every drafted token.
    engine = make_engine(tiny_llama, block_size=2, num_blocks=256, speculative_method="draft",
                         num_speculative_tokens=6, draft_num_layers=tiny_llama.model.num_layers)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    engine.add_request("probe", prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    events = run_to_end_events(engine)
    tokens = [e.token_id for e in events if isinstance(e, ev.TokenSampled)]
    # A token emitted inside a step that accepted drafts, at least 2 accepted tokens before the
    # run's end (so the KV computed past it reaches into the next block), and new to the output.
    emitted, stop_index = 0, None
    for step in sorted({e.step for e in events}):
        n_tokens = sum(1 for e in events if e.step == step and isinstance(e, ev.TokenSampled))
        accepted = sum(e.num_accepted for e in events if e.step == step and isinstance(e, ev.DraftVerified))
        for j in range(max(0, accepted - 2)):
            if tokens[emitted + j] not in tokens[: emitted + j]:
                stop_index = emitted + j
                break
        if stop_index is not None:
            break
        emitted += n_tokens
    assert stop_index is not None, "the probe run never accepted 3 drafts in one step"
    stop_at = tokens[stop_index]
    engine.clear_prefix_cache()
    engine.add_request("r", prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[stop_at]))
    out = run_to_end(engine)["r"].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: stop_index + 1]
    final = prompt + out.token_ids
    for node in engine.radix.nodes.values():
        path = [t for n in reversed(node.path()) for t in n.tokens]
        assert final[: len(path)] == path


def test_copy_on_write_with_the_triton_block_copy_kernel(tiny_llama):
    """The Triton backend copies shared blocks with its own kernel (interpreted on CPU): the forks
    read the same K/V as with torch, so their log-probs agree (tokens alone barely depend on it)."""
    pytest.importorskip("triton")
    outs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=32, attention_backend=backend)
        engine.add_request("p", list(range(3, 9)), SamplingParams(n=2, max_tokens=4, seed=3, logprobs=0,
                                                                  ignore_eos=True))
        events = []
        engine.subscribe(events.append)
        out = run_to_end(engine)["p"]
        assert any(isinstance(e, ev.CowCopied) for e in events)
        outs[backend] = out.outputs
    for torch_c, triton_c in zip(outs["torch"], outs["triton"]):
        assert torch_c.token_ids == triton_c.token_ids
        got = [lp[t] for lp, t in zip(triton_c.logprobs, triton_c.token_ids)]
        want = [lp[t] for lp, t in zip(torch_c.logprobs, torch_c.token_ids)]
        assert got == pytest.approx(want, abs=1e-4)
