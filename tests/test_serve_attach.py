"""`nanoserve tui --attach URL`: the frames of a server watched over /events equal the frames of a
local live engine (the live TUI's LiveSource) running the same workload; the app starts in attach
mode with read-only controls and a clients panel; bad URLs, unreachable servers and keys fail clearly.

The workload arrives while the server's loop is paused, so every request is added before step 1 on
both sides and the two engines make the same decisions step by step (same weights: tiny-llama is
seeded by the config)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from pathlib import Path

import openai
import pytest
from serve_helpers import client, on_engine
from test_tui import WIDE, notices, panels, run_async, wait_for
from test_tui_keys import key_bar

import nanoserve_tui.app
from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.events import RequestAdded, StepFinished, StepStarted
from nanoserve.scenarios import Arrival, Scenario
from nanoserve.serve.app import build_app
from nanoserve.serve.background import BackgroundServer
from nanoserve.trace import ViewState, event_to_dict
from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.attach import AttachSource, TraceFolder, sse_messages
from nanoserve_tui.attach_app import AttachApp, run_attach
from nanoserve_tui.live_source import LiveSource
from nanoserve_tui.widgets.clients import ClientsPanel

# A pool small enough to preempt, a budget small enough to chunk the longer prompts.
# 20 blocks: every arrival order of WORKLOAD preempts (24 left about 1 order in 10 without a preemption)
CONFIG = dict(block_size=4, num_blocks=20, max_num_batched_tokens=24, max_num_seqs=4)
WORKLOAD = [("Hello there!", 12), ("Paged attention", 10), ("The quick brown fox jumps over the lazy dog", 8),
            ("Continuous batching", 14), ("Blocks and tables", 9), ("One more", 11)]


def comparable(state: ViewState) -> ViewState:
    """The state without wall-clock durations (the only thing two runs may differ in)."""
    state = dataclasses.replace(state, history=[(s, p, d, f, 0.0) for s, p, d, f, _ in state.history])
    if state.last_step is not None:
        state.last_step = dataclasses.replace(state.last_step, duration_s=0.0)
    return state


def comparable_events(events) -> list:
    return [dataclasses.replace(e, duration_s=0.0) if isinstance(e, StepFinished) else e for e in events]


class Recording:
    """Mixin: keep every frame the app is handed."""

    CSS_PATH = str(Path(nanoserve_tui.app.__file__).with_name("app.tcss"))   # (relative paths follow the subclass)

    def on_frame_ready(self, message) -> None:
        self.frames.append(message.frame)


class RecordingAttachApp(Recording, AttachApp):
    frames: list


class RecordingLiveApp(Recording, NanoserveApp):
    frames: list


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(model="tiny-llama", **CONFIG))
    app = build_app(engine, step_delay=0.03)          # slow enough for the TUI to draw most steps
    with BackgroundServer(app) as background:
        yield background.url, app.state.server


def send_workload(url: str, srv) -> list[Arrival]:
    """The workload, sent while the engine is paused; returns it as arrivals in the server's order."""
    srv.engine_loop.pause()
    threads = [threading.Thread(target=lambda p=p, m=m: client(url).completions.create(
        model="tiny-llama", prompt=p, max_tokens=m, temperature=0, stream=False,
        extra_body={"ignore_eos": True})) for p, m in WORKLOAD]
    for t in threads:
        t.start()
    try:
        waiting = []
        for _ in range(500):
            waiting = on_engine(srv, lambda e: [(s.seq_id, s.prompt) for s in e.scheduler.waiting])
            if len(waiting) == len(WORKLOAD):
                break
            threading.Event().wait(0.02)
        assert len(waiting) == len(WORKLOAD), waiting
    finally:
        srv.engine_loop.resume()
    for t in threads:
        t.join(120)
    budget = dict(WORKLOAD)
    return [Arrival(0, rid, prompt, dict(max_tokens=budget[prompt], temperature=0, ignore_eos=True))
            for rid, prompt in waiting]


@run_async
async def test_attach_frames_equal_a_local_live_engine(server):
    url, srv = server
    attached = RecordingAttachApp(AttachSource(url))
    attached.frames = []
    async with attached.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: attached.frames)
        assert attached.frames[0].state.step == 0 and not attached.frames[0].state.sequences
        arrivals = await asyncio.to_thread(send_workload, url, srv)
        await wait_for(pilot, lambda: len(attached.frame.state.finished) == len(WORKLOAD), timeout=60)
        await pilot.pause(0.3)
        seen_attached = panels(attached)
        clients = attached.query_one(ClientsPanel).text

    # The same workload on a local live engine, stepped by the live TUI.
    live_source = LiveSource(model="tiny-llama")
    live_source.scenario = Scenario("server-workload", "the attach test's requests", CONFIG, arrivals)
    live = RecordingLiveApp(live_source)
    live.frames = []
    async with live.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: live.frame is not None)
        while not live.frame.at_end:
            step = live.frame.state.step
            await pilot.press("n")
            await wait_for(pilot, lambda: live.frame.state.step > step or live.frame.at_end)
        await pilot.pause()
        seen_live = panels(live)

    local = {f.state.step: f for f in live.frames}
    compared = [f for f in attached.frames if f.state.step >= 1]
    assert len(compared) >= 5, f"only {len(compared)} attached frames"
    for frame in compared:
        twin = local[frame.state.step]
        assert comparable(frame.state) == comparable(twin.state), f"step {frame.state.step}"
        assert comparable_events(frame.events) == comparable_events(twin.events), f"step {frame.state.step}"
    assert compared[-1].state.step == max(local)                        # both ran to the same end
    assert any("Preempted" in str(e) for f in live.frames for e in f.events)   # the workload preempts
    for name in ("pool", "tables", "free", "requests", "radix"):        # and the panels draw the same
        assert seen_attached[name] == seen_live[name], name
    assert clients.count("done") == len(WORKLOAD)


@run_async
async def test_attach_mode_is_read_only_with_a_clients_panel(server):
    url, srv = server
    app = AttachApp(AttachSource(url))
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        status = str(app.query_one("#status").render())
        assert "ATTACH" in status and url in status
        assert "following the server" in status and "paused" not in status   # it never pauses a server
        await wait_for(pilot, lambda: key_bar(app))                # the footer draws its keys a moment later
        assert key_bar(app) == {"help", "quit", "palette"}      # the controls that would drive it are hidden
        await asyncio.to_thread(lambda: client(url).completions.create(model="tiny-llama", prompt="Hi from a student",
                                                                max_tokens=3, user="ada"))
        panel = app.query_one(ClientsPanel)
        await wait_for(pilot, lambda: "ada" in panel.text and "done" in panel.text)
        assert "watching" in panel.border_title
        for key in ("space", "a", "x", "f", "b", "p"):
            await pilot.press(key)
        text = notices(app)
        assert text.count("attached to a server") >= 6
        assert not app.playing


def test_sse_messages_parses_types_ids_and_comments():
    lines = [": ping", "", "id: 3", "data: {\"a\": 1}", "", "event: clients", "data: x", "data: y", "", "data: z", ""]
    assert list(sse_messages(lines)) == [("message", '{"a": 1}', "3"), ("clients", "x\ny", None),
                                         ("message", "z", None)]


def test_trace_folder_folds_whole_batches_only():
    engine = LLMEngine(EngineConfig(model="tiny-llama", **CONFIG))
    events = []
    engine.subscribe(events.append)
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    steps = []
    folder = TraceFolder(on_step=lambda s: steps.append(s.step))
    for e in events[:-1]:
        assert not folder.feed(e, batch_end=False)
    assert folder.state is None                                   # nothing drawn mid-batch
    assert folder.feed(events[-1], batch_end=True) and folder.state.step == 1 and steps == [1]
    assert isinstance(folder.recent[0], StepStarted) and any(isinstance(e, RequestAdded) for e in events)
    assert event_to_dict(folder.recent[-1])["type"] == "StepFinished"


def test_bad_attach_urls_fail_with_one_line(capsys):
    assert run_attach("localhost:8000") == 2
    assert "needs a server URL like http://127.0.0.1:8000" in capsys.readouterr().err
    assert run_attach("http://127.0.0.1:8000", scenario="memory-pressure") == 2


@run_async
async def test_unreachable_server_and_wrong_key_are_clear_errors(tiny_llama):
    with socket.socket() as s:                                    # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = AttachApp(AttachSource(f"http://127.0.0.1:{port}"))
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.error is not None)
        assert "could not attach" in app.error
    engine = LLMEngine(EngineConfig(model=tiny_llama.name, **CONFIG), loaded=tiny_llama)
    with BackgroundServer(build_app(engine, api_key="k")) as background:
        app = AttachApp(AttachSource(background.url, api_key="wrong"))
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.error is not None)
            assert "API key" in app.error
        app = AttachApp(AttachSource(background.url, api_key="k"))
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.frame is not None)
            with pytest.raises(openai.AuthenticationError):
                await asyncio.to_thread(lambda: client(background.url).models.list())
