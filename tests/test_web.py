"""`nanoserve web`: the TUI served to browsers by textual-serve.

The real server runs as `nanoserve web` in a subprocess (stopped by its pid);
a browser tab is Debian's Chromium under playwright, or, where only the
server's rules are checked (the key, the seats), a plain HTTP client and a
websocket. The live test presses the keys a student presses (a, a prompt,
Enter, space) and reads the new step in the screen the tab was sent.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from browser import launch, needs_browser

from nanoserve.cli import main
from nanoserve_tui.web_command import tab_command, who_can_reach

TRACE = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def web(*flags: str, timeout: float = 60):
    """`nanoserve web FLAGS` on a free port of 127.0.0.1; yields (url, process). Stopped, with its tabs, by pid."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOSERVE_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "web", "--port", str(port), *flags], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(url + "/static/css/xterm.css", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "nanoserve web did not start"
                time.sleep(0.2)
        yield url, proc
    finally:
        tabs = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGINT)                # as Ctrl+C: the tabs' apps are told to quit
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        for tab in tabs:                               # whatever did not quit in time
            if tab.is_running():
                tab.kill()


def test_tabs_run_the_terminal_s_own_command(tmp_path):
    class Args:
        replay = attach = compare = model = scenario = None

    args = Args()
    args.replay = "t.jsonl"
    assert tab_command(args)[-3:] == ["tui", "--replay", os.path.abspath("t.jsonl")]
    args.replay, args.compare = None, ["a.jsonl", "b.jsonl"]
    assert tab_command(args)[3:5] == ["compare", "--trace"] and tab_command(args)[-1] == "--tui"
    args.compare, args.model, args.scenario = None, "tiny-llama", "memory-pressure"
    assert tab_command(args)[3:] == ["tui", "--threads", "1", "--model", "tiny-llama", "--scenario", "memory-pressure"]


def test_the_start_line_says_who_can_reach_the_page():
    (only,) = who_can_reach("127.0.0.1", 8080, None)
    assert "only this machine" in only
    (open_,) = who_can_reach("0.0.0.0", 8080, None)
    assert open_.startswith("warning:") and "anyone on a network" in open_ and "--api-key" in open_
    (keyed,) = who_can_reach("0.0.0.0", 8080, "s3cret")
    assert "only with the key" in keyed and "s3cret" not in keyed      # the key is not printed on a projector


def test_a_busy_port_is_one_line_and_exit_2(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        capsys.readouterr()
        code = main(["web", "--replay", str(TRACE), "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0], err


def test_what_would_fail_in_every_tab_fails_before_serving(capsys, tmp_path):
    for argv, words in ((["--replay", str(tmp_path / "none.jsonl")], "trace not found"),
                        (["--replay", str(TRACE), "--scenario", "memory-pressure"], "--scenario starts a live"),
                        (["--scenario", "nope"], "nope"), (["--model", "/no/such/dir"], "unknown model"),
                        (["--compare", str(TRACE), str(tmp_path / "b.jsonl")], "trace not found")):
        capsys.readouterr()
        code = main(["web", *argv, "--port", "0"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and words in err[0] and err[0].startswith("nanoserve: error:"), err


def test_the_key_and_the_seats():
    import asyncio

    import aiohttp

    with web("--replay", str(TRACE), "--api-key", "s3cret", "--max-sessions", "1") as (url, _):
        refused = httpx.get(url + "/")
        assert refused.status_code == 401 and "Basic" in refused.headers["WWW-Authenticate"]
        assert httpx.get(url + "/?key=wrong").status_code == 401
        assert httpx.get(url + "/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        basic = base64.b64encode(b"student:s3cret").decode()
        assert httpx.get(url + "/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        link = httpx.get(url + "/?key=s3cret")                     # the link a teacher hands out
        assert link.status_code == 302 and "key" not in link.headers["Location"]
        cookie = link.cookies["nanoserve_web"]
        assert "s3cret" not in cookie
        page = httpx.get(url + "/", cookies={"nanoserve_web": cookie})
        assert page.status_code == 200 and f'ws://{url.removeprefix("http://")}/ws' in page.text
        assert "googleapis" not in page.text                        # nothing from the internet

        async def tabs() -> tuple[bytes, int]:
            ws_url = url.replace("http", "ws") + "/ws?width=120&height=40"
            async with aiohttp.ClientSession(cookies={"nanoserve_web": cookie}) as session:
                async with session.ws_connect(ws_url) as first:
                    screen = b""
                    while b"step 0/" not in screen:               # the app's first screen, from its process
                        message = await asyncio.wait_for(first.receive(), 60)
                        screen += message.data if isinstance(message.data, bytes) else b""
                    with pytest.raises(aiohttp.WSServerHandshakeError) as second:
                        await session.ws_connect(ws_url)          # one seat: the next tab is turned away
                    return screen, second.value.status

        screen, status = asyncio.run(tabs())
        assert status == 503

        async def no_cookie() -> int:
            async with aiohttp.ClientSession() as session:
                try:
                    await session.ws_connect(url.replace("http", "ws") + "/ws")
                except aiohttp.WSServerHandshakeError as exc:
                    return exc.status
            return 0
        assert asyncio.run(no_cookie()) == 401


@needs_browser
def test_a_live_tab_adds_a_request_and_steps():
    from playwright.sync_api import sync_playwright

    with web("--model", "tiny-llama") as (url, server), sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            received = []                                  # what the tab's terminal was sent to draw
            page.on("websocket", lambda ws: ws.on("framereceived", lambda f: received.append(
                f if isinstance(f, bytes) else f.encode())))

            def shows(pattern: bytes, since: int = 0, timeout: float = 120) -> int:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if re.search(pattern, b"".join(received[since:])):
                        return len(received)
                    page.wait_for_timeout(200)
                raise AssertionError(f"the tab never showed {pattern!r}")

            page.goto(url)
            ready = shows(rb"step 0(?!\d)")                # the engine loaded: the status bar says step 0
            page.click("#terminal")                        # keys go to the terminal, as a student's click
            page.keyboard.press("a")
            shows(rb"Add a request", ready)                # the dialog is up: what is typed goes into it
            page.keyboard.type("Hello there")
            page.keyboard.press("Enter")
            added = shows(rb"added u1", ready)
            page.keyboard.press(" ")
            shows(rb"step 1(?!\d)", added)
            assert server.poll() is None
        finally:
            browser.close()


# -- --shared: one app for a class --------------------------------------------------------


async def _read_until(ws, pattern: bytes, timeout: float = 60) -> bytes:
    import asyncio

    screen = b""
    while not re.search(pattern, screen):
        message = await asyncio.wait_for(ws.receive(), timeout)
        assert message.type.name in ("BINARY", "TEXT"), f"the tab was closed: {message}"
        screen += message.data if isinstance(message.data, bytes) else b""
    return screen


def test_shared_tabs_watch_one_app_and_a_late_tab_gets_the_whole_screen():
    import asyncio

    import aiohttp

    with web("--replay", str(TRACE), "--shared") as (url, server):
        async def class_() -> int:
            ws_url = url.replace("http", "ws") + "/ws?width=80&height=24"
            async with aiohttp.ClientSession() as session:
                teacher = await session.ws_connect(ws_url, max_msg_size=0)
                await _read_until(teacher, rb"step 0/")
                students = [await session.ws_connect(ws_url, max_msg_size=0) for _ in range(3)]
                for s in students:                 # joined after the first screen: redrawn for them (Ctrl+L)
                    screen = await _read_until(s, rb"step 0/")
                    assert b"block tables" in screen and b"free queue" in screen
                apps = [p for p in psutil.Process(server.pid).children(recursive=True) if "python" in p.name()]
                await teacher.send_json(["stdin", " "])                   # the teacher steps ...
                await asyncio.gather(*(_read_until(t, rb"step 1/") for t in (teacher, *students)))   # ... all see it
                for t in (teacher, *students):
                    await t.close()
                return len(apps)

        assert asyncio.run(class_()) == 1                  # one app process for four tabs


def test_only_this_machine_types_into_the_shared_app(monkeypatch):
    """A student's key would move everyone's screen: keys from another machine are dropped."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from nanoserve_tui import web_shared
    from nanoserve_tui.web_server import WebServer

    assert web_shared.from_this_machine("127.0.0.1", set()) and web_shared.from_this_machine("::1", set())
    assert web_shared.from_this_machine("::ffff:127.0.0.1", set())
    assert web_shared.from_this_machine("192.168.1.7", {"192.168.1.7"})   # the teacher by the network address
    assert not web_shared.from_this_machine("192.168.1.8", {"192.168.1.7"})
    assert not web_shared.from_this_machine(None, set()) and not web_shared.from_this_machine("x", set())

    command = f"{sys.executable} -m nanoserve tui --replay {TRACE}"
    monkeypatch.setattr(web_shared, "from_this_machine", lambda remote, local: False)   # every tab a student's

    async def student() -> bytes:
        server = WebServer(command, title="t", shared=True)
        async with TestClient(TestServer(await server._make_app())) as client:
            ws = await client.ws_connect("/ws", max_msg_size=0)
            await _read_until(ws, rb"step 0/")
            await ws.send_json(["stdin", " "])
            await ws.send_json(["ping", "p1"])          # answered after the key was handled
            seen = b""
            try:
                seen = await _read_until(ws, rb"step 1/", timeout=5)
            except asyncio.TimeoutError:
                pass
            await ws.close()
            return seen

    assert b"step 1/" not in asyncio.run(student())


@needs_browser
def test_a_shared_tab_shows_the_whole_screen_in_a_small_window():
    """The shared app is 160x50 cells whatever the window: the tab's terminal is that grid, scaled to fit."""
    from playwright.sync_api import sync_playwright

    with web("--replay", str(TRACE), "--shared") as (url, _), sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 800, "height": 600})
            sizes = []
            page.on("websocket", lambda ws: ws.on("framesent", lambda f: sizes.append(f) if "resize" in f else 0))
            page.goto(url)
            page.wait_for_function("document.body.classList.contains('-first-byte')", timeout=60_000)
            page.wait_for_timeout(1000)
            assert sizes and sizes[-1] == '["resize",{"width":160,"height":50}]', sizes
            box = page.locator("#terminal .xterm-screen").bounding_box()
            assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= 800 and box["y"] + box["height"] <= 600
            assert box["width"] > 700 or box["height"] > 500               # ... and fills the window
        finally:
            browser.close()


# -- what a tab may send: sizes clamped, malformed frames end that tab alone ----------------------


def test_a_tab_s_size_is_clamped_and_its_frames_checked():
    from aiohttp import WSMessage, WSMsgType

    from nanoserve_tui.web_frames import MAX_SIZE, BadFrame, clamp_size, read_frame

    assert clamp_size("100000", "100000") == MAX_SIZE and clamp_size("0", "-5") == (1, 1)
    assert clamp_size("x", None) == (80, 24) and clamp_size(10**400, 30) == (MAX_SIZE[0], 30)
    assert clamp_size(float("inf"), "9" * 5000) == (80, 24)

    def text(data: str) -> WSMessage:
        return WSMessage(WSMsgType.TEXT, data, None)

    assert read_frame(text('["resize", {"width": 100000, "height": 100000}]')) == ("resize", MAX_SIZE)
    assert read_frame(text('["stdin", "q"]')) == ("stdin", "q") and read_frame(text('["focus"]')) == ("focus", None)
    for bad in (text("not json"), text("[]"), text('["stdin", 5]'), text("{}"), text("[5]"),
                text('["resize", 3]'), WSMessage(WSMsgType.BINARY, b"\x00\xff", None)):
        with pytest.raises(BadFrame):
            read_frame(bad)


class _RecordingApp:
    """Stands in for textual-serve's AppService (no app process): records the sizes it is given."""

    sizes: list = []

    def __init__(self, *args, **kwargs) -> None:
        pass

    async def start(self, width, height):
        self.sizes.append((width, height))

    async def set_terminal_size(self, width, height):
        self.sizes.append((width, height))

    async def send_bytes(self, data):
        pass

    async def stop(self):
        pass


def test_a_tab_cannot_ask_for_a_huge_screen(monkeypatch):
    import asyncio

    import textual_serve.server
    from aiohttp.test_utils import TestClient, TestServer

    from nanoserve_tui.web_frames import MAX_SIZE
    from nanoserve_tui.web_server import WebServer

    monkeypatch.setattr(textual_serve.server, "AppService", _RecordingApp)
    _RecordingApp.sizes = []

    async def tab() -> None:
        server = WebServer("true", title="t")
        async with TestClient(TestServer(await server._make_app())) as client:
            ws = await client.ws_connect("/ws?width=100000&height=100000")
            await ws.send_json(["resize", {"width": 99999, "height": 7}])
            await ws.send_json(["ping", "p"])
            assert (await ws.receive_json(timeout=30)) == ["pong", "p"]
            await ws.close()

    asyncio.run(tab())
    assert _RecordingApp.sizes == [MAX_SIZE, (MAX_SIZE[0], 7)]


@pytest.mark.parametrize("shared", [False, True])
def test_a_malformed_frame_ends_that_tab_with_one_log_line(monkeypatch, caplog, shared):
    """Not JSON, [], ["stdin", 5], binary: each ends its own tab, with one warning and no traceback; a
    tab beside them goes on."""
    import asyncio
    import logging

    import aiohttp
    import textual_serve.app_service
    import textual_serve.server
    from aiohttp.test_utils import TestClient, TestServer

    from nanoserve_tui import web_shared
    from nanoserve_tui.web_server import WebServer

    monkeypatch.setattr(textual_serve.server, "AppService", _RecordingApp)
    monkeypatch.setattr(web_shared, "AppService", _RecordingApp)
    bad_frames = [("str", "not json"), ("str", "[]"), ("str", '["stdin", 5]'), ("bytes", b"\x1b[2J\xff")]

    async def tabs() -> list:
        server = WebServer("true", title="t", shared=shared)
        async with TestClient(TestServer(await server._make_app())) as client:
            good = await client.ws_connect("/ws")
            ends = []
            for how, frame in bad_frames:
                ws = await client.ws_connect("/ws")
                await (ws.send_str(frame) if how == "str" else ws.send_bytes(frame))
                ends.append((await ws.receive(timeout=30)).type)
                await ws.close()
            await good.send_json(["ping", "still here"])
            assert (await good.receive_json(timeout=30)) == ["pong", "still here"]
            await good.close()
            return ends

    with caplog.at_level(logging.WARNING):
        ends = asyncio.run(tabs())
    assert ends == [aiohttp.WSMsgType.CLOSE] * len(bad_frames)
    lines = [r for r in caplog.records if "its session ends" in r.getMessage()]
    assert len(lines) == len(bad_frames) and not any(r.exc_info for r in caplog.records)
    assert all("\x1b" not in r.getMessage() for r in caplog.records)
