"""`nanoserve export --format html`: a trace as one self-contained page of the TUI's own frames.

The page is checked where a student opens it, in a real browser from file://:
move to step k with the arrow keys or the slider, and the block tables and the
free count on the page equal the trace's fold at step k. Without a browser,
the frames are read back from the file and checked the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from browser import block_tables, free_count, launch, needs_browser, screen_text

from nanoserve.cli import main
from nanoserve.trace import fold, read_trace
from nanoserve_tui.replay_html import BUDGET_BYTES, export_html, pick, unpack

TRACE = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"


def fold_after(events, step: int):
    """The view state after step `step`: every event of steps 0..step, folded (the fold, not the TUI's source)."""
    state = None
    for event in events:
        if event.step > step:
            break
        state = fold(state, event)
    return state


def expected(state) -> tuple[dict[str, list[int]], tuple[int, int]]:
    live = state.running + state.waiting + state.swapped
    return ({rid: list(state.sequences[rid].block_table) for rid in live},
            (len(state.free_queue), state.num_blocks))


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "replay.html"
    return export_html(TRACE, out)


def frames_of(path: Path) -> dict:
    text = path.read_text()
    blob = re.search(r'<script id="frames" type="application/json">(.*?)</script>', text, re.S)[1]
    return json.loads(blob)


def test_every_frame_is_the_tui_at_its_step_and_equals_the_fold(replay):
    events = read_trace(TRACE)
    data = frames_of(replay.path)
    assert not replay.sampled and data["steps"] == list(range(len(data["steps"])))
    assert replay.size <= BUDGET_BYTES
    for k in (0, 5, 13, data["steps"][-1]):
        rows = screen_text(unpack(data["frames"][k]))
        assert f"step {k}/{data['last_step']}" in rows[1], rows[1]           # the TUI's own status bar
        tables, free = expected(fold_after(events, k))
        assert block_tables(rows) == tables and free_count(rows) == free, k


def test_the_page_asks_nothing_of_the_network(replay):
    text = replay.path.read_text()
    assert "https://" not in text and "http://" not in text.replace("http://www.w3.org/", "")
    for frame in frames_of(replay.path)["frames"][:3]:
        assert "cdnjs" not in unpack(frame) and 'url("http' not in unpack(frame)


def test_a_long_trace_is_sampled_to_the_budget(tmp_path):
    assert pick(10, 20) == list(range(10))
    chosen = pick(100, 7, keep=51)
    assert chosen[0] == 0 and chosen[-1] == 99 and 51 in chosen and len(chosen) == 8
    small = export_html(TRACE, tmp_path / "few.html", max_frames=4)
    assert small.sampled and small.steps[0] == 0 and small.steps[-1] == 37 and len(small.steps) == 4
    assert "4 of the trace's 38 steps" in frames_of(small.path)["note"]
    tight = export_html(TRACE, tmp_path / "tight.html", max_frames=4, budget=small.size - 20_000)
    assert tight.size <= small.size - 20_000 and len(tight.steps) < 4 and tight.steps[0] == 0


def run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_bad_traces_are_one_line_and_exit_2(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(TRACE.read_text()[:500] + "\n{oops\n")
    for trace, words in ((tmp_path / "missing.jsonl", "trace not found"), (corrupt, "corrupt.jsonl:")):
        code, err = run(capsys, "export", "-t", str(trace), "-f", "html", "-o", str(tmp_path / "r.html"))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "r.html").exists()
    code, err = run(capsys, "export", "-t", str(TRACE), "-f", "html", "-w", "pool")
    assert code == 2 and "--what does not apply to --format html" in err


SERIALIZE = "svg => new XMLSerializer().serializeToString(svg)"   # the SVG on the page, as XML


@needs_browser
def test_the_page_in_a_browser_shows_the_fold_at_step_k(replay):
    from playwright.sync_api import sync_playwright

    events = read_trace(TRACE)
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            asked = []
            page.on("request", lambda r: asked.append(r.url))
            page.goto(replay.path.as_uri())
            page.wait_for_selector("#screen[data-step='0']")
            for _ in range(13):                            # the arrow keys, as a student steps
                page.keyboard.press("ArrowRight")
            page.keyboard.press("ArrowLeft")
            k = 12
            page.wait_for_selector(f"#screen[data-step='{k}']")
            rows = screen_text(page.eval_on_selector("#screen svg", SERIALIZE))
            tables, free = expected(fold_after(events, k))
            assert block_tables(rows) == tables and free_count(rows) == free
            assert page.text_content("#position") == f"step {k}/37"
            # the slider: drag it to step 25
            page.eval_on_selector("#slider", "s => { s.value = 25; s.dispatchEvent(new Event('input')); }")
            page.wait_for_selector("#screen[data-step='25']")
            rows = screen_text(page.eval_on_selector("#screen svg", SERIALIZE))
            tables, free = expected(fold_after(events, 25))
            assert block_tables(rows) == tables and free_count(rows) == free
            assert all(url.startswith("file://") for url in asked), asked   # nothing from the network
        finally:
            browser.close()
