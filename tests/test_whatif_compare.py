"""Comparing two runs (nanoserve/whatif/compare.py) and `nanoserve compare` from the command line."""

from __future__ import annotations

import pytest

from nanoserve import EngineConfig, SamplingParams
from nanoserve import events as ev
from nanoserve.cli import main
from nanoserve.whatif import Run
from nanoserve.whatif.compare import compare, first_divergence
from nanoserve.whatif.settings import parse_sets
from nanoserve.whatif.workload import scenario_pair, scenario_run


@pytest.fixture(scope="module")
def pressure(tiny_llama):
    """memory-pressure as written (recompute) and with swap."""
    return scenario_pair("memory-pressure", {"preemption_mode": "swap"}, tiny_llama.name, tiny_llama)


def test_identical_configs_do_not_diverge(tiny_llama):
    a = scenario_run("continuous-batching", {}, tiny_llama.name, tiny_llama)
    b = scenario_run("continuous-batching", {}, tiny_llama.name, tiny_llama)
    c = compare(a, b)
    assert c.first_divergence is None and not c.settings
    assert all(x == y for _, x, y in c.total_rows())
    assert all(x == y for _, x, y in c.request_rows())
    assert "no divergence" in str(c)
    assert "peak blocks in use" in repr(c) and "<table" not in repr(c) and "peak blocks" in c._repr_html_()


def test_cache_off_computes_exactly_the_prefix_hits_again(tiny_llama):
    a, b = scenario_pair("shared-system-prompt", {"enable_prefix_caching": False}, tiny_llama.name, tiny_llama)
    c = compare(a, b)
    hits = c.a.totals()["prefix hit tokens"]
    assert hits > 0 and c.b.totals()["prefix hit tokens"] == 0
    assert c.a.totals()["preemptions"] == c.b.totals()["preemptions"] == 0
    assert c.difference("prefill tokens computed") == hits
    assert c.settings == {"enable_prefix_caching": (True, False)}
    # the cache's own events (lookups, inserts) differ from step 1; the compute differs from the first hit
    assert c.first_divergence == 1
    first_hit = next(e.step for e in a.events if isinstance(e, ev.PrefixMatched) and e.num_hit_tokens)
    prefill = [[s.prefill_tokens for s in m.steps] for m in (c.a, c.b)]
    assert prefill[0][:first_hit - 1] == prefill[1][:first_hit - 1]
    assert prefill[0][first_hit - 1] < prefill[1][first_hit - 1]


def test_swap_instead_of_recompute(pressure):
    a, b = pressure
    c = compare(a, b)
    assert c.a.totals()["swaps"] == 0 < c.b.totals()["swaps"]
    first_preemption = next(e.step for e in a.events if isinstance(e, ev.Preempted))
    assert c.first_divergence == first_preemption      # the same run until the policy is asked
    # greedy-free plain workload: sampled with per-request seeds, so the same tokens either way
    tokens = [{(e.seq_id, e.token_id) for e in run.events if isinstance(e, ev.TokenSampled)} for run in pressure]
    assert tokens[0] == tokens[1]
    text = str(c)
    assert "preemption_mode recompute -> swap" in text and f"first diverge at step {first_preemption}" in text


def test_branch_with_swapped_preemption_mode_shows_in_the_difference_panel(tiny_llama):
    run = Run.start(EngineConfig(model=tiny_llama.name, block_size=4, num_blocks=12, max_num_batched_tokens=32),
                    loaded=tiny_llama)
    for i in range(4):
        run.add_request(f"r{i}", list(range(10 + i, 20 + 2 * i)), SamplingParams(max_tokens=14, temperature=0,
                                                                                ignore_eos=True))
    run.run_to()
    first = next(e.step for e in run.events if isinstance(e, ev.Preempted))
    branch = run.branch(first, preemption_mode="swap").run_to()
    c = compare(run, branch)
    assert c.difference("swaps") > 0
    assert c.a.totals()["preemptions"] > 0
    outputs = [{rid: [e.token_id for e in r.events if isinstance(e, ev.TokenSampled) and e.seq_id == rid]
                for rid in ("r0", "r1", "r2", "r3")} for r in (run, branch)]
    assert outputs[0] == outputs[1]                     # greedy: identical text
    assert compare(run, run.branch(first).run_to()).first_divergence is None


def test_first_divergence_on_made_up_streams():
    sync = ev.EngineSynced(0, "m", 4, 2, (0,) * 4, (0, 1, 2, 3), ())
    step = lambda s, free: [ev.StepStarted(s, 0, 0), ev.StepFinished(s, 0, 0, 0, free, 0.1 * s)]
    a = [sync, *step(1, 4), *step(2, 4)]
    assert first_divergence(a, a) is None
    assert first_divergence(a, [sync, *step(1, 4), *step(2, 3)]) == 2
    assert first_divergence(a, [sync, *step(1, 4)]) == 2                 # one run stopped earlier


def test_parse_sets_reads_values_by_field_type():
    assert parse_sets(["block_size=8", "enable_prefix_caching=off", "speculative_method=none",
                       "kv_cache_memory_mb=1.5", "preemption-mode=swap"]) == {
        "block_size": 8, "enable_prefix_caching": False, "speculative_method": None, "kv_cache_memory_mb": 1.5,
        "preemption_mode": "swap"}


def _cli(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr()


@pytest.mark.parametrize("item, says", [
    ("block_sise=8", "--set block_sise=8: block_sise is not an engine setting"),
    ("block_size=zero", "--set block_size=zero: block_size is not a whole number"),
    ("block_size=0", "--set block_size=0: block_size must be at least 1"),
    ("preemption_mode=swop", "--set preemption_mode=swop: preemption_mode must be one of"),
    ("nokey", "--set 'nokey' is not key=value"),
    ("seed=3", "--set seed=3: both runs share one loaded model"),
])
def test_a_bad_set_is_one_line_and_exit_2(capsys, item, says):
    code, out = _cli(capsys, "compare", "--scenario", "memory-pressure", "--set", item)
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"nanoserve: error: {says}"), out.err


def test_cli_compare_scenario_and_traces(capsys, tmp_path, tiny_llama):
    code, out = _cli(capsys, "compare", "--scenario", "memory-pressure", "--model", tiny_llama.name,
                     "--set", "preemption_mode=swap", "--save", str(tmp_path / "mp"))
    assert code == 0 and "first diverge at step" in out.out and "swaps" in out.out
    code, again = _cli(capsys, "compare", "--trace", str(tmp_path / "mp-a.jsonl"), "--trace",
                       str(tmp_path / "mp-b.jsonl"))
    assert code == 0 and again.out.startswith("mp-a vs mp-b (preemption_mode recompute -> swap")
    # the saved traces measure as the runs did
    saved = compare(tmp_path / "mp-a.jsonl", tmp_path / "mp-b.jsonl")
    live = compare(*scenario_pair("memory-pressure", {"preemption_mode": "swap"}, tiny_llama.name, tiny_llama))
    assert saved.total_rows() == live.total_rows() and saved.request_rows() == live.request_rows()
    assert saved.first_divergence == live.first_divergence
    code, out = _cli(capsys, "compare", "--trace", str(tmp_path / "mp-a.jsonl"))
    assert code == 2 and "--trace must be given exactly twice" in out.err
