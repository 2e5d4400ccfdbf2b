"""Issue 52 in a browser (playwright driving /usr/bin/chromium): the web view's pool legend fits a
1400×900 and an 800×600 window, and a replay page's status line says running while it plays."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from browser import launch, needs_browser
from rich.text import Text
from test_web import web

from nanoserve.trace import read_trace
from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.source import ReplaySource
from nanoserve_tui.widgets.pool import PoolPanel

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "docs" / "traces" / "memory-pressure.jsonl"


def legend_at(size: tuple[int, int], step: int = 29) -> str:
    """The pool panel's bottom border (its legend) in the TUI at `size` (columns, rows), at a step with blocks."""
    async def run():
        source = ReplaySource(read_trace(TRACE))
        source.goto(step)
        app = NanoserveApp(source)
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.3)
            panel = app.query_one(PoolPanel)
            subtitle = panel.border_subtitle
            return Text.from_markup(subtitle or "").plain, panel.size.width

    text, width = asyncio.run(run())
    assert len(text) + 4 <= width, (text, width)
    return text


@needs_browser
@pytest.mark.parametrize("window", [(1400, 900), (800, 600)])
def test_the_pool_legend_fits_the_web_view(window):
    """The browser's terminal size (what the page asks of the app) gets a legend that is there, whole."""
    from playwright.sync_api import sync_playwright

    with web("--replay", str(TRACE)) as (url, _), sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": window[0], "height": window[1]})
            sent = []
            page.on("websocket", lambda ws: ws.on("framesent", lambda f: sent.append(f)))
            page.goto(url)
            page.wait_for_function("document.body.classList.contains('-first-byte')", timeout=120_000)
            page.wait_for_timeout(500)
        finally:
            browser.close()
    sizes = [json.loads(f)[1] for f in sent if isinstance(f, str) and f.startswith('["resize"')]
    assert sizes, sent[:5]
    size = (sizes[-1]["width"], sizes[-1]["height"])
    text = legend_at(size)
    assert "free" in text and "shared" in text and "cached" in text and "request" in text, (size, text)


@needs_browser
def test_the_replay_page_says_running_while_it_plays():
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "replay.html"
        subprocess.run([sys.executable, "-m", "nanoserve", "export", "-t", str(TRACE), "-f", "html", "-o", str(out),
                        "--step", "1"], check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True)
        with sync_playwright() as p:
            browser = launch(p)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                page.goto(out.as_uri())
                page.wait_for_selector("#screen svg")

                def status() -> str:
                    return page.evaluate("[...document.querySelectorAll('#screen svg text')]"
                                         ".map(t => t.textContent).find(t => /^(paused|running)$/.test(t))")

                assert status() == "paused"
                page.click("#play")
                page.wait_for_timeout(1600)          # two frames later: still says so on the new frame
                assert status() == "running" and page.inner_text("#play").endswith("pause")
                page.click("#play")
                assert status() == "paused"
            finally:
                browser.close()
