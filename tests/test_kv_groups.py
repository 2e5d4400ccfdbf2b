"""KV cache groups (kv_groups.py): Gemma 3's local layers free the blocks their window passed.

tiny-gemma3 has a window of 8 tokens on two of its three layers; with 4-token blocks and prompts of up to
71 tokens, blocks really leave the window. Greedy tokens with freeing on equal those with it off and HF's,
through chunked prefill, preemption (recompute and swap), prefix-cache hits, forks, beams and n-gram
speculation; `check_invariants` after every step holds each windowed table to its window (and the pool's,
the tree's and the CPU pool's books across groups).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import make_engine, run_to_end, save_tiny
from engine_checks import FoldWatcher, drive
from test_parity import hf_greedy, prompts

from nanoserve import SamplingParams
from nanoserve import events as ev
from nanoserve.engine_state import fold_mismatches
from nanoserve.kv_groups import FREED, KVGroup, make_groups, max_window_blocks
from nanoserve.models.loader import load_model
from nanoserve.trace import JsonlRecorder, fold_all
from nanoserve.trace_check import check_trace, load_trace

MAX_TOKENS = 16
ROOT = Path(__file__).resolve().parents[1]
WINDOW_BLOCKS = max_window_blocks(8, 4)   # tiny-gemma3's window, 4-token blocks: 3

CASES = {
    # name: engine config (4-token blocks; the pool in whole-model blocks, as num_blocks always counts)
    "chunked": dict(max_num_batched_tokens=16, num_blocks=256),
    "no-chunking": dict(max_num_batched_tokens=128, num_blocks=256, enable_chunked_prefill=False),
    "preempt-recompute": dict(max_num_batched_tokens=32, num_blocks=40),
    "preempt-swap": dict(max_num_batched_tokens=32, num_blocks=40, preemption_mode="swap"),
    "no-prefix-cache": dict(max_num_batched_tokens=24, num_blocks=64, enable_prefix_caching=False),
    "ngram": dict(max_num_batched_tokens=32, num_blocks=256, speculative_method="ngram",
                  num_speculative_tokens=3),
    "draft": dict(max_num_batched_tokens=32, num_blocks=256, speculative_method="draft",
                  num_speculative_tokens=3, draft_num_layers=2),
    "reading-path": dict(max_num_batched_tokens=24, num_blocks=64, path="reading"),   # kernels/reference.py
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = save_tiny("tiny-gemma3", tmp_path_factory.mktemp("gemma3"))
    return path, load_model(path)


@pytest.fixture(scope="module")
def hf(gemma):
    return hf_greedy(gemma[0], prompts(257), MAX_TOKENS)


def greedy_run(loaded, prompt_list, **config):
    """Greedy tokens by request, and what the groups did: (tokens, BlocksLeftWindow events, preemptions,
    the most blocks a windowed table held between steps)."""
    engine = make_engine(loaded, block_size=4, **config)
    watcher, events = FoldWatcher(engine), []   # the viewers' fold follows every group's blocks
    engine.subscribe(events.append)
    left, most = [], 0
    engine.subscribe(lambda e: left.append(e) if isinstance(e, ev.BlocksLeftWindow) else None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompt_list):
        engine.add_request(str(i), p, params)
    finished, preempted = {}, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()          # includes: a windowed table holds only its window's blocks
        watcher.check(engine)
        preempted += result.stats.num_preempted
        finished.update({o.request_id: o for o in result.outputs if o.finished})
        most = max([most] + [sum(b != FREED for b in t) for s in engine.sequences.values() for t in s.group_tables])
    check_trace(events)                 # the trace's block books balance, group by group
    greedy_run.events = events
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompt_list))], left, preempted, most


def test_groups_follow_the_layer_kinds():
    assert make_groups([8, 8, None], True) == [KVGroup(None, (2,)), KVGroup(8, (0,)), KVGroup(8, (1,))]
    assert make_groups([512] * 5 + [None] + [512] * 5 + [None], True) == [
        KVGroup(None, (5, 11)), *(KVGroup(512, pair) for pair in [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)])]
    assert make_groups([8, 8, None], False) == [KVGroup(None, (0, 1, 2))]       # freeing off: today's layout
    assert make_groups([None, None], True) == [KVGroup(None, (0, 1))]           # no window: one group
    assert make_groups([8, 8], True) == [KVGroup(None, (0, 1))]                 # every layer windowed: no freeing
    assert max_window_blocks(8, 4) == 3 and max_window_blocks(512, 16) == 33


@pytest.mark.parametrize("case", CASES)
def test_window_freeing_keeps_greedy_tokens(case, gemma, hf):
    """Freeing on, freeing off and HF give the same tokens; with freeing on blocks did leave the window,
    and no windowed table ever held more than its window's blocks (+1)."""
    path, loaded = gemma
    on, left, preempted, most = greedy_run(loaded, prompts(257), **CASES[case])
    off, left_off, _, _ = greedy_run(loaded, prompts(257), kv_window_freeing=False, **CASES[case])
    assert on == off == hf
    assert left and not left_off
    assert 0 < most <= WINDOW_BLOCKS
    if case.startswith("preempt"):
        assert preempted > 0


def test_prefix_cache_across_the_window(gemma):
    """A 37-token shared prefix, far past the 8-token window: the second wave hits it, taking from the
    local groups only the cached blocks their windows still need, and gives HF's tokens."""
    path, loaded = gemma
    rng = random.Random(3)
    shared = [rng.randrange(257) for _ in range(37)]
    waves = [[shared + [rng.randrange(257) for _ in range(n)] for n in lens] for lens in ([1, 9], [4, 2, 15, 6])]
    engine = make_engine(loaded, block_size=4, num_blocks=24, max_num_batched_tokens=24)
    hits = []
    engine.subscribe(lambda e: hits.append(e) if isinstance(e, ev.PrefixMatched) and e.num_hit_tokens else None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    got = []
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            engine.add_request(f"{w}.{i}", p, params)
        out = run_to_end(engine)
        got += [out[f"{w}.{i}"].outputs[0].token_ids for i in range(len(wave))]
    assert got == hf_greedy(path, [p for wave in waves for p in wave], MAX_TOKENS)
    big = [h for h in hits if h.num_hit_tokens >= 36]
    assert len(big) >= 4
    for h in big:   # a local group takes only the blocks its window still needs
        for table in h.group_block_ids:
            assert table[0] == FREED and sum(b != FREED for b in table) <= WINDOW_BLOCKS


def test_a_short_pool_takes_passed_companions_first(gemma):
    """Shared prefixes in a short pool: the cache gives back the blocks a window passed (CompanionEvicted)
    before whole nodes, hits are cut back to what the windows still have, and the tokens stay HF's."""
    path, loaded = gemma
    rng = random.Random(0)
    shared = [rng.randrange(257) for _ in range(30)]
    prompt_list = [shared + [rng.randrange(257) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    on, left, _, most = greedy_run(loaded, prompt_list, num_blocks=40, max_num_batched_tokens=32)
    evicted = [e for e in greedy_run.events if isinstance(e, ev.CompanionEvicted)]
    hits = [e for e in greedy_run.events if isinstance(e, ev.PrefixMatched) and e.num_hit_tokens]
    off, *_ = greedy_run(loaded, prompt_list, num_blocks=40, max_num_batched_tokens=32, kv_window_freeing=False)
    assert on == off == hf_greedy(path, prompt_list, MAX_TOKENS)
    assert evicted and hits and 0 < most <= WINDOW_BLOCKS


@pytest.mark.parametrize("kind", ["n", "beams", "swap-n"])
def test_forks_and_beams_across_groups(kind, gemma):
    """n > 1 (sampled, seeded) and beam search: the same completions with freeing on and off, the fold of
    the events equal to the engine's snapshot after every step."""
    path, loaded = gemma
    if kind == "beams":
        params = SamplingParams(max_tokens=MAX_TOKENS, n=2, beam_width=3, temperature=0, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=MAX_TOKENS, n=3, temperature=1.0, seed=7, ignore_eos=True)
    extra = dict(preemption_mode="swap", num_blocks=40) if kind == "swap-n" else dict(num_blocks=128)
    results = []
    for freeing in (True, False):
        engine = make_engine(loaded, block_size=4, max_num_batched_tokens=32, kv_window_freeing=freeing, **extra)
        watcher = FoldWatcher(engine)
        for i, p in enumerate(prompts(257)[8:14]):
            engine.add_request(str(i), p, params)
        out = drive(engine, watcher)
        results.append({k: sorted(tuple(c.token_ids) for c in o.outputs) for k, o in out.items()})
    assert results[0] == results[1]


# -- traces ------------------------------------------------------------------------------------------

def test_traces_recorded_before_groups_still_replay():
    """The tests' traces, recorded before groups (format 1, no groups), load, check and fold as before."""
    paths = sorted((ROOT / "tests/data").glob("*.jsonl"))
    assert len(paths) >= 3
    for path in paths:
        events = load_trace(path)
        assert events[0].trace_version == 1 and not events[0].kv_groups
        state = fold_all(events)
        assert all(not s.group_tables for s in state.sequences.values()) and not state.companions


def test_a_grouped_trace_joined_mid_run_round_trips(gemma, tmp_path):
    """A recorder that joins mid-run gets the groups in EngineSynced (tables with left-window entries,
    the cache's companions); the JSONL replays, passes the checks, and folds to the engine's snapshot."""
    path, loaded = gemma
    engine = make_engine(loaded, block_size=4, num_blocks=64, max_num_batched_tokens=24)
    rng = random.Random(5)
    shared = [rng.randrange(257) for _ in range(30)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), shared + [rng.randrange(257) for _ in range(5 + 7 * i)], params)
    for _ in range(6):
        engine.step()
    trace = tmp_path / "groups.jsonl"
    with JsonlRecorder(trace) as rec:
        engine.subscribe(rec)
        for i in range(3, 5):
            engine.add_request(str(i), shared + [rng.randrange(257) for _ in range(3)], params)
        run_to_end(engine)
    events = load_trace(trace)
    synced = events[0]
    assert synced.trace_version == ev.TRACE_VERSION == 2
    assert len(synced.kv_groups) == 3 and synced.companions
    assert any(b == FREED for _, tables, _ in synced.group_tables for t in tables for b in t)
    assert any(isinstance(e, ev.BlocksLeftWindow) for e in events)
    assert not fold_mismatches(fold_all(events), engine.snapshot())


def test_a_trace_newer_than_the_reader_is_refused(tmp_path):
    lines = (ROOT / "docs/traces/long-prompt.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["trace_version"] = ev.TRACE_VERSION + 1
    bad = tmp_path / "newer.jsonl"
    bad.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="newer than this nanoserve"):
        load_trace(bad)


# -- the pictures ------------------------------------------------------------------------------------

def window_state(loaded):
    """The view, folded from events, at the end of the first step where a block left a window."""
    engine = make_engine(loaded, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    events = []
    engine.subscribe(events.append)
    engine.add_request("r1", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    state = None
    while engine.has_unfinished_requests():
        engine.step()
        state = fold_all(events)
        if state.left_window:
            return state
    raise AssertionError("no block left the window")


def test_tui_and_graphviz_draw_the_groups(gemma):
    """The TUI's block-table panel lists each group's table with `·` where a block left the window; the
    pool panel labels the blocks that left this step; Graphviz draws the same."""
    from nanoserve.viz.graphviz import pool_dot, tables_dot
    from nanoserve_tui.widgets.pool import _cell_lines
    from nanoserve_tui.widgets.tables import TablesLayout

    state = window_state(gemma[1])
    layout = TablesLayout(state, 200)
    text = ["".join(seg.text for seg in layout.line(i)) for i in range(layout.count)]
    assert sum("g1 W8" in t or "g2 W8" in t for t in text) == 2 and any("→·" in t for t in text)
    owners = state.block_owners()
    kinds = state.block_kinds(owners)
    gone = next(iter(state.left_window))
    assert _cell_lines(state, gone, owners, kinds[gone], 3)[1] == "←window"
    held = state.sequences["r1"].group_tables[0][-1]
    assert _cell_lines(state, held, owners, kinds[held], 3)[1] == "r1/g1"
    assert "left the window" in tables_dot(state) and "group 2 · window 8" in tables_dot(state)
    assert "← window" in pool_dot(state)


# -- the issue's target, at Gemma 3's shape (slow) ---------------------------------------------------

def long_gemma3_run(loaded, prompt, new_tokens: int, **config):
    """Greedy tokens of one long request, and per step the live blocks of each of its tables."""
    engine = make_engine(loaded, block_size=16, num_blocks=600, max_num_batched_tokens=512, **config)
    engine.add_request("long", prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    held, out = [], None
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.check_invariants()
        seq = engine.sequences.get("long")
        if seq is not None:
            held.append([sum(b != FREED for b in t) for t in [seq.block_table, *seq.group_tables]])
        out = next((o for o in result.outputs if o.finished), out)
    return out.outputs[0].token_ids, held


@pytest.mark.slow
def test_a_4000_token_gemma3_shaped_request_holds_a_window_per_local_group(tmp_path):
    """Gemma 3's shape: five sliding layers (window 512) to one full layer. A 3,500-token prompt and 500
    generated tokens: each local group holds at most ceil(511 / 16) + 1 = 33 blocks after every step, the
    global one all 250; the tokens equal those with freeing off, and HF's."""
    path = save_tiny("tiny-gemma3", tmp_path, num_hidden_layers=6, sliding_window=512,
                     layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=4096)
    loaded = load_model(path)
    rng = random.Random(11)
    prompt = [rng.randrange(257) for _ in range(3500)]
    on, held = long_gemma3_run(loaded, prompt, 500)
    off, held_off = long_gemma3_run(loaded, prompt, 500, kv_window_freeing=False)
    assert len(held[-1]) == 6 and len(held_off[-1]) == 1
    assert max(max(h[1:]) for h in held) <= max_window_blocks(512, 16) == 33
    assert held[-1][0] == held_off[-1][0] == 250
    assert on == off == hf_greedy(path, [prompt], 500)[0]


@pytest.mark.parametrize("where, fail_at, config", [
    ("run", 4, {}), ("copy_blocks", "first", {}),
    ("swap_out", "first", dict(preemption_mode="swap", num_blocks=10)),
    ("swap_in", "first", dict(preemption_mode="swap", num_blocks=10)),
    ("run", 6, dict(speculative_method="ngram")),
])
def test_a_failed_step_is_undone_across_groups(gemma, where, fail_at, config):
    """test_hardening's failure injection on tiny-gemma3: a copy or swap into any group's block that never
    ran sends its sequence back to recompute; invariants and the fold hold; the outputs are unchanged."""
    from engine_checks import tokens
    from test_hardening import run_workload

    reference, _, _ = run_workload(gemma[1], **config)
    finished, caught, failures = run_workload(gemma[1], fail_at, where, **config)
    assert failures and len(caught) == 1
    if where in ("copy_blocks", "swap_in", "swap_out"):
        assert any(isinstance(e, ev.Preempted) and e.mode == "recompute" for e in caught[0].result.events)
    for rid in ("g", "s", "n"):
        assert tokens(finished)[rid] == tokens(reference)[rid], rid


@pytest.mark.slow
def test_the_state_machine_on_gemma3():
    """test_engine_stateful's Hypothesis machine (every mechanism, injected failures, fold == snapshot,
    outputs equal to a mechanisms-off reference) on tiny-gemma3 with window freeing, in its own process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NANOSERVE_MACHINE_MODEL": "tiny-gemma3", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_engine_stateful.py")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:]
