"""The Graphviz exporter: DOT source checked against the folded view state, always;
rendering checked only where the `dot` program is installed."""

from __future__ import annotations

import re
import shutil

import pytest
from memory_events import memory_state

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.errors import FieldError
from nanoserve.events import Preempted, StepFinished
from nanoserve.scenarios import record
from nanoserve.trace import SequenceView, ViewState, fold_all, read_trace
from nanoserve.viz.graphviz import (
    SHARED_FILL,
    TOUCHED_LINE,
    engine_svg,
    export_trace,
    pool_dot,
    radix_dot,
    state_at,
    state_from_snapshot,
    state_of,
    tables_dot,
)

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="rendering needs the Graphviz `dot` program (apt-get install graphviz)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "pressure.jsonl"
    record("memory-pressure", path)
    return path


@pytest.fixture(scope="module")
def preempt_step(trace):
    """The first step in which a request was preempted (the scenario exists to make one)."""
    return next(e.step for e in read_trace(trace) if isinstance(e, Preempted))


def last_step(trace) -> int:
    return max(e.step for e in read_trace(trace) if isinstance(e, StepFinished))


def node_line(source: str, name: str) -> str:
    """The DOT line that declares node `name`."""
    lines = [ln for ln in source.splitlines() if ln.strip().startswith(f"{name} [")]
    assert len(lines) == 1, f"node {name} not declared once in:\n{source}"
    return lines[0]


def node_of(state: ViewState, rid: str) -> str:
    """A request's node name: its arrival index (request ids may hold ':' or spaces)."""
    return f"req{list(state.sequences).index(rid)}"


def shared_state() -> ViewState:
    """Three running requests; a and b share physical block 1; blocks 1 and 5 touched this step."""
    s = ViewState(3, "hand-made", 8, 4, [1, 2, 1, 0, 0, 1, 0, 0], [3, 4, 6, 7])
    s.sequences["a"] = SequenceView("a", "x", 8, 4, "running", num_computed_tokens=6, block_table=[0, 1])
    s.sequences["b"] = SequenceView("b", "y", 8, 4, "running", num_computed_tokens=7, block_table=[2, 1])
    s.sequences["c"] = SequenceView("c", "z", 3, 4, "running", num_computed_tokens=3, block_table=[5])
    s.sequences["w"] = SequenceView("w", "z", 3, 4, "waiting")
    s.running, s.waiting, s.touched_blocks = ["a", "b", "c"], ["w"], {1, 5}
    return s


# -- block tables ---------------------------------------------------------------------
def test_tables_arrows_match_block_tables_at_every_step(trace):
    for step in range(1, last_step(trace) + 1):
        state = state_at(trace, step)
        source = tables_dot(state)
        arrows = set(re.findall(r"(req\d+):b(\d+):e -> physical:p(\d+):w", source))
        expected = {(node_of(state, rid), str(i), str(b)) for rid in state.running + state.waiting
                    for i, b in enumerate(state.sequences[rid].block_table)}
        assert arrows == expected, f"step {step}"
        for rid in state.running + state.waiting:
            if state.sequences[rid].block_table:
                assert f"<B>{rid}</B>" in node_line(source, node_of(state, rid))
            else:  # waiting without blocks: listed in one small box
                assert f">{rid}</TD>" in node_line(source, "no_blocks")
        for rid in state.finished:
            assert f"{node_of(state, rid)} [" not in source and f"<B>{rid}</B>" not in source


def test_tables_show_ref_counts_and_partial_last_block(trace, preempt_step):
    state = state_at(trace, preempt_step)
    source = tables_dot(state)
    physical = node_line(source, "physical")
    refs = dict(re.findall(r'PORT="p(\d+)"[^>]*><B>#\d+</B></TD><TD[^>]*>(?:<B>)?ref (\d+)', physical))
    expected = {str(b): str(r) for b, r in enumerate(state.ref_counts) if r > 0}
    assert refs == expected and refs, "every block in use, and only those, with its ref count"
    for rid in state.running:
        req, bs = state.sequences[rid], state.block_size
        last = len(req.block_table) - 1
        held = req.num_computed_tokens - last * bs
        assert 0 < held <= bs
        assert re.search(rf'PORT="b{last}"[^>]*>{held}/{bs}</TD>', node_line(source, node_of(state, rid)))
        assert f"{req.num_computed_tokens} tokens in KV" in source


def test_awkward_request_ids():
    state = shared_state()
    state.sequences = {f"chat:{k} <x>": v for k, v in state.sequences.items()}
    state.running, state.waiting = ["chat:a <x>", "chat:b <x>", "chat:c <x>"], ["chat:w <x>"]
    source = tables_dot(state)
    assert "chat:a &lt;x&gt;" in source and "req0:b1:e -> physical:p1:w" in source


def test_tables_highlight_shared_blocks():
    source = tables_dot(shared_state())
    rows = dict(re.findall(r'PORT="p(\d+)" BGCOLOR="([^"]+)"', node_line(source, "physical")))
    assert rows["1"] == SHARED_FILL and "ref 2 · shared" in source
    assert all(fill != SHARED_FILL for block, fill in rows.items() if block != "1")
    # both requests point at block 1, each with its own colour
    assert "req0:b1:e -> physical:p1:w" in source and "req1:b1:e -> physical:p1:w" in source
    colours = dict(re.findall(r'(req\d):b0:e -> physical:p\d+:w \[color="([^"]+)"\]', source))
    assert len(set(colours.values())) == 3


# -- the pool -------------------------------------------------------------------------
CELL = re.compile(r'<TD WIDTH="\d+" HEIGHT="\d+" BGCOLOR="([^"]+)"( BORDER="3" COLOR="[^"]+")?[^>]*>'
                  r'<B>#(\d+)</B><BR/>(.*?)</TD>')


def pool_cells(source: str) -> dict[int, tuple[str, bool, str]]:
    """Block id -> (fill, outlined, caption) from the pool grid."""
    return {int(b): (fill, bool(outline), caption)
            for fill, outline, b, caption in CELL.findall(node_line(source, "grid"))}


def free_queue_ids(source: str) -> list[int]:
    return [int(b) for b in re.findall(r'<TD BGCOLOR="[^"]+">(\d+)</TD>', node_line(source, "free_queue"))]


def test_pool_cells_owners_touched_and_free_queue(trace, preempt_step):
    state = state_at(trace, preempt_step)
    assert state.touched_blocks, "a preemption step frees blocks"
    source = pool_dot(state)
    cells, owners, kinds = pool_cells(source), state.block_owners(), state.block_kinds()
    assert sorted(cells) == list(range(state.num_blocks))
    for block, (fill, outlined, caption) in cells.items():
        assert outlined == (block in state.touched_blocks), block
        assert ("free" in caption) == (state.ref_counts[block] == 0)
        if kinds[block] == "owned":          # one request (and maybe the prefix cache: "+tree")
            assert caption.split("<FONT")[0] == owners[block][0]
        elif kinds[block] == "shared":
            assert f"shared ×{state.ref_counts[block]}" in caption
    assert f'COLOR="{TOUCHED_LINE}"' in source
    assert free_queue_ids(source) == state.free_queue
    assert "head" in source and "tail" in source


def test_pool_shared_block_and_empty_queue():
    state = shared_state()
    cells = pool_cells(pool_dot(state))
    assert cells[1][0] == SHARED_FILL and "shared ×2" in cells[1][2]
    assert {b for b, cell in cells.items() if cell[1]} == {1, 5}
    state.free_queue = []
    assert "(empty)" in pool_dot(state)


def test_radix_without_prefix_caching_is_a_clear_error():
    with pytest.raises(ValueError, match="no radix tree: prefix caching was off.*enable_prefix_caching=True"):
        radix_dot(shared_state())


# -- steps and errors ---------------------------------------------------------------------
def test_state_at_steps(trace):
    events = read_trace(trace)
    last = last_step(trace)
    assert state_at(trace, None) == fold_all(events)
    assert state_at(trace, last) == fold_all(events)
    before = state_at(trace, 0)
    assert before.step == 0 and not before.running and before.last_step is None
    middle = state_at(trace, 5)
    assert middle.step == 5 and middle.last_step.step == 5 and middle.running


def test_state_at_errors(trace, tmp_path):
    last = last_step(trace)
    with pytest.raises(ValueError, match=f"0 to {last}"):
        state_at(trace, last + 1)
    with pytest.raises(ValueError, match=f"0 to {last}"):
        state_at(trace, -1)
    with pytest.raises(FileNotFoundError, match="trace not found"):
        state_at(tmp_path / "missing.jsonl")
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(trace.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ValueError, match="corrupt.jsonl:2"):
        state_at(corrupt)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError):
        state_at(empty)


def test_export_dot_names_and_contents(trace):
    path = export_trace(trace, 5, "pool", "dot")
    assert path == trace.with_name("pressure-pool-5.dot")
    assert path.read_text() == pool_dot(state_at(trace, 5))
    assert export_trace(trace, None, "tables", "dot").name == "pressure-tables-end.dot"
    if state_at(trace, 5).prefix_caching:
        assert "radix tree" in export_trace(trace, 5, "radix", "dot").read_text()
    else:
        with pytest.raises(ValueError, match="no radix tree"):
            export_trace(trace, 5, "radix", "dot")
    with pytest.raises(ValueError, match="unknown format"):
        export_trace(trace, 5, "pool", "pdf")


def test_export_without_dot_refuses_and_writes_nothing(trace, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_DOT", str(tmp_path / "no-such-dot"))
    with pytest.raises(FieldError, match="svg needs Graphviz") as refused:
        export_trace(trace, 3, "tables", "svg", tmp_path / "out.svg")
    assert refused.value.field == "format" and "apt-get install graphviz" in refused.value.text
    assert "brew install graphviz" in refused.value.text and not list(tmp_path.iterdir())
    path = export_trace(trace, 3, "tables", "dot", tmp_path / "out.dot")    # the source needs no Graphviz
    assert path.read_text() == tables_dot(state_at(trace, 3))
    assert engine_svg(shared_state()) is None


# -- rendering ------------------------------------------------------------------------------
@needs_dot
@pytest.mark.parametrize("what", ["tables", "pool"])
def test_render_svg_and_png(trace, preempt_step, tmp_path, what):
    svg = export_trace(trace, preempt_step, what, "svg", tmp_path / f"{what}.svg")
    text = svg.read_text()
    assert "<svg" in text[:1000] and text.rstrip().endswith("</svg>")
    png = export_trace(trace, preempt_step, what, "png", tmp_path / f"{what}.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


@needs_dot
def test_render_memory_pictures():
    state = memory_state(5)
    for what in ("radix", "pool", "tables"):
        svg = engine_svg(state, what)
        assert "<svg" in svg[:1000] and svg.rstrip().endswith("</svg>"), what


@needs_dot
def test_engine_svg_of_state_and_snapshot():
    assert "<svg" in engine_svg(shared_state())
    assert "<svg" in engine_svg(shared_state(), "pool")


# -- live engines ---------------------------------------------------------------------------
def test_state_of_live_engine_matches_snapshot():
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=16))
    engine.add_request("r1", "Hello there", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("r2", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    state = state_of(engine)
    assert not engine.bus.active, "state_of unsubscribes again"
    snapshot = engine.snapshot()
    for r in snapshot["sequences"]:
        assert state.sequences[r["seq_id"]].block_table == r["block_table"]
    assert state.ref_counts == snapshot["pool"]["ref_counts"]
    assert state.free_queue == snapshot["pool"]["free_queue"]
    from_snapshot = state_from_snapshot(snapshot)
    assert tables_dot(from_snapshot) == tables_dot(state)
    assert pool_dot(from_snapshot) == pool_dot(state)
