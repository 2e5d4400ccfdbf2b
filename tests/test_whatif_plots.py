"""Plots (nanoserve/whatif/plots.py): the numbers behind each figure against the live engine, and rendering.

The run is stepped live; after every step we write down what the engine
itself says (its snapshot's free queue and ref counts, its radix tree, its
swapped queue, the StepResult's stats). The figures are then built from the
run's trace alone, and their data must equal those notes.
"""

from __future__ import annotations

import pytest

from nanoserve import EngineConfig, SamplingParams
from nanoserve import events as ev
from nanoserve.cli import main
from nanoserve.trace import write_trace
from nanoserve.whatif import Run
from nanoserve.whatif.compare import compare
from nanoserve.whatif.metrics import measure
from nanoserve.whatif.plots import FIGURES, blocks_data, figure, latency_data, save_figure, timeline_data, tokens_data

SHARED = list(range(60, 72))


@pytest.fixture(scope="module")
def watched(tiny_llama):
    """A run with swapping, a prefix cache and a fork, and the engine's own account after each step."""
    run = Run.start(EngineConfig(model=tiny_llama.name, block_size=4, num_blocks=14, max_num_batched_tokens=20,
                                 preemption_mode="swap"), loaded=tiny_llama)
    notes = {}
    for i in range(4):
        run.add_request(f"r{i}", SHARED + [i] * (i + 1), SamplingParams(max_tokens=12, ignore_eos=True))
    while not run.done:
        result = run.step()
        if run.step_count == 3:
            run.fork("r0")
        engine, snap = run.engine, run.engine.snapshot()
        refs = snap["pool"]["ref_counts"]
        tree = {b for blocks in engine.radix.held_blocks() for b in blocks}
        notes[run.step_count] = dict(
            free=len(snap["pool"]["free_queue"]), cached=sum(1 for b in tree if refs[b] == 1),
            swapped_blocks=sum(len(r["cpu_block_table"]) for r in snap["sequences"]),
            swapped=set(snap["swapped"]), waiting=set(snap["waiting"]), stats=result.stats,
            sampled={o.request_id for o in result.outputs})
    return run, notes


def test_the_run_swaps_and_hits_the_cache(watched):
    run, _ = watched
    kinds = {type(e) for e in run.events}
    assert {ev.SwappedOut, ev.SwappedIn, ev.Forked} <= kinds
    assert any(e.num_hit_tokens for e in run.events if isinstance(e, ev.PrefixMatched))


def test_blocks_in_use_per_step_equal_the_snapshot(watched):
    run, notes = watched
    d = blocks_data(measure(run.events))
    assert d["step"] == list(notes)
    for i, step in enumerate(d["step"]):
        assert d["free"][i] == notes[step]["free"]
        assert d["cached"][i] == notes[step]["cached"]
        assert d["used"][i] == 14 - notes[step]["free"] - notes[step]["cached"]
        assert d["swapped"][i] == notes[step]["swapped_blocks"]
    assert max(d["swapped"]) > 0 and max(d["cached"]) > 0


def test_tokens_per_step_equal_the_step_stats(watched):
    run, notes = watched
    d = tokens_data(measure(run.events))
    assert d["prefill"] == [notes[s]["stats"].num_prefill_tokens for s in d["step"]]
    assert d["decode"] == [notes[s]["stats"].num_decode_tokens for s in d["step"]]


def test_timeline_phases_agree_with_the_queues(watched):
    run, notes = watched
    d = timeline_data(measure(run.events))
    assert set(d) == {"r0", "r1", "r2", "r3", "r0.1"}
    for rid, phases in d.items():
        for step, phase in phases.items():
            assert (phase == "swapped") == (rid in notes[step]["swapped"]), (rid, step)
            if phase in ("waiting", "preempted"):
                assert rid in notes[step]["waiting"]
    assert any("swapped" in p.values() for p in d.values())
    # a request's last cell is its finishing step
    m = measure(run.events)
    assert all(max(d[rid]) == m.requests[rid].finish_step for rid in d)


def test_latency_data_sums_the_measured_step_times(watched):
    run, notes = watched
    m = measure(run.events)
    d = latency_data(m)
    first = {e.seq_id: e.step for e in reversed(run.events) if isinstance(e, ev.TokenSampled)}
    expect = {rid: 1000 * sum(notes[s]["stats"].duration_s for s in range(m.requests[rid].added_step + 1, step + 1))
              for rid, step in first.items()}
    assert d["ttft_ms"] == pytest.approx([expect[rid] for rid in m.ttft_s()])
    tokens = sum(len(r.token_steps) for r in m.requests.values())
    assert len(d["itl_ms"]) == tokens - len(m.ttft_s())


@pytest.mark.parametrize("what", list(FIGURES))
def test_every_figure_renders_headless(watched, what, tmp_path):
    run, _ = watched
    for suffix in (".png", ".svg"):
        path = save_figure(run, what, tmp_path / f"{what}{suffix}")
        assert path.stat().st_size > 1000
    assert path.read_text().lstrip().startswith("<?xml")


def test_a_comparison_is_drawn_side_by_side(watched):
    run, _ = watched
    other = run.branch(0, preemption_mode="recompute").run_to()
    fig = figure(compare(run, other), "blocks")
    assert [ax.get_title() for ax in fig.axes] == ["A", "B"]


def test_cli_plot(watched, tmp_path, capsys):
    run, _ = watched
    write_trace(tmp_path / "t.jsonl", run.events)
    assert main(["plot", "--trace", str(tmp_path / "t.jsonl"), "--what", "timeline", "-o",
                 str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t.svg").exists()
    capsys.readouterr()
    assert main(["plot", "--trace", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "t.pdf")]) == 2
    assert capsys.readouterr().err.strip() == f"nanoserve: error: --output must end in .png or .svg, got {tmp_path / 't.pdf'}"
