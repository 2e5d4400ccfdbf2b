"""The browser pages: the replay of the memory-pressure scenario on the home page, and screenshots of both.

* `docs/replay/<scenario>.html`: `nanoserve export --format html` of every
  scenario's SmolLM2 recording (docs/traces/, as the TUI's screenshots); the home
  page shows memory-pressure's in a frame, each lesson links its own.
* `docs/img/web-replay.png`: that page in Chromium at its showcase step;
* `docs/img/web-tui.png`: `nanoserve web --replay` of the same trace in
  Chromium, after the space key stepped it twice.

Both screenshots are taken by playwright driving Debian's /usr/bin/chromium
(tests/browser.py's launch); the job checks on the page what the screenshot
shows (the step), since a PNG's pixels are not compared (fonts render
slightly differently from one Chromium to the next: the docs check compares
a PNG's size, a replay's frames by their screen text).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from docgen import ROOT, Result
from docgen.traces import path as shipped
from nanoserve.scenarios import SCENARIOS
from nanoserve.trace import read_trace
from nanoserve_tui.replay_html import export_html
from nanoserve_tui.screenshots import showcase_step

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def _web(trace: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOSERVE_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "web", "--replay", str(trace), "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            httpx.get(url + "/static/css/xterm.css", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("nanoserve web did not start")


def make(read) -> Result:
    from playwright.sync_api import sync_playwright

    out = Result()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # (before playwright: it runs its own event loop.) The scenarios recorded on SmolLM2, whose text
        # reads well; one that names its own random-weight model (sliding-window) is watched in the TUI.
        for name in (n for n, scenario in SCENARIOS.items() if scenario.model is None):
            trace = shipped(name)
            replay = export_html(trace, tmp / f"{name}.html", step=showcase_step(name, read_trace(trace)))
            assert not replay.sampled, f"{name}: the docs' replays show every step"
            out.files[f"docs/replay/{name}.html"] = replay.path.read_bytes()
        trace = shipped("memory-pressure")
        step = showcase_step("memory-pressure", read_trace(trace))
        replay = export_html(trace, tmp / "memory-pressure.html", step=step)   # it opens at its showcase step
        with sync_playwright() as p:
            _shoot(p, replay, step, trace, out)
    return out


def _shoot(p, replay, step: int, trace: Path, out: Result) -> None:
    """The two screenshots (see the module docstring)."""
    browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(replay.path.as_uri())
        page.wait_for_selector("#screen svg")
        page.keyboard.press("ArrowLeft")             # the arrow keys step it, as a reader does
        page.keyboard.press("ArrowRight")
        page.wait_for_timeout(500)
        assert f"step {step}/" in page.inner_text("#position"), page.inner_text("#position")
        out.files["docs/img/web-replay.png"] = page.screenshot()

        proc, url = _web(trace)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            sent = []
            page.on("websocket", lambda ws: ws.on("framereceived", lambda f: sent.append(
                f if isinstance(f, bytes) else f.encode())))
            page.goto(url)
            page.wait_for_function("document.body.classList.contains('-first-byte')", timeout=120_000)
            page.click("#terminal")
            for _ in range(2):
                page.keyboard.press(" ")
            for _ in range(100):
                if re.search(rb"step 2/", b"".join(sent)):
                    break
                page.wait_for_timeout(100)
            else:
                raise AssertionError("nanoserve web never showed step 2")
            page.wait_for_timeout(1000)
            out.files["docs/img/web-tui.png"] = page.screenshot()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    finally:
        browser.close()
