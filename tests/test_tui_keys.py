"""What a first-time user of the TUI presses: focus, the key bar, dialogs, the command palette.

Pilot tests (`App.run_test()`): which widget has focus after a key, what the
key bar lists in each mode, that a dialog takes typing at once, that a rewind
says so while it replays, that a branch's settings stay on screen, that the
grid keeps its layout when a block is selected, and that the add dialog wraps
the prompt in the model's chat template when the model has one.
"""

from __future__ import annotations

import threading

from test_tui import NARROW, WIDE, live_app, notices, replay_app, run_async, step_of, wait_for

from nanoserve.whatif.run import Run
from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.live_source import LiveSource
from nanoserve_tui.screens import AddRequestScreen, BranchScreen, HelpScreen
from nanoserve_tui.widgets.pool import PoolGrid
from nanoserve_tui.widgets.requests import RequestList
from nanoserve_tui.widgets.status import status_text

LIVE_ONLY = {"add", "abort", "fork", "what if"}


def key_bar(app: NanoserveApp) -> set[str]:
    """The descriptions the footer shows (Textual's own footer widgets)."""
    from textual.widgets._footer import FooterKey

    return {key.description for key in app.query(FooterKey)}


def status(app: NanoserveApp) -> str:
    return str(app.query_one("#status").render())


# -- focus -------------------------------------------------------------------------------------


@run_async
async def test_first_tab_focuses_the_pool_grid_and_arrows_still_select_requests():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(5)
        await pilot.pause()
        assert app.focused is None                               # nothing takes the keys before Tab
        await pilot.press("tab")
        assert isinstance(app.focused, PoolGrid)
        await pilot.press("right")
        assert app.query_one(PoolGrid).selected == 0
        await pilot.press("tab", "tab", "tab", "tab")            # reading order: tables, free queue, radix, requests
        assert isinstance(app.focused, RequestList)
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(5)
        await pilot.pause()
        await pilot.press("down")                                # no panel focused: ↑/↓ pick a request
        assert isinstance(app.focused, RequestList) and app.query_one(RequestList).selected == "r0"


@run_async
async def test_selecting_a_block_keeps_the_grid_layout():
    """The block details have a fixed height: a selection must not shrink the grid into a layout without
    owners (it went from 3 lines per cell to 2, and from 8 columns to 12)."""
    for size in (WIDE, NARROW, (160, 44)):
        app = replay_app()
        async with app.run_test(size=size) as pilot:
            app.source.goto(5)
            await pilot.pause()
            grid = app.query_one(PoolGrid)
            before = (grid.size, grid.layout_)
            await pilot.click("#pool-grid", offset=(2, 0))
            await pilot.pause()
            assert grid.selected == 0 and "ref count" in str(app.query_one("#block-info").render())
            assert (grid.size, grid.layout_) == before, size


# -- the key bar ---------------------------------------------------------------------------------


@run_async
async def test_replay_key_bar_lists_no_live_only_keys_but_the_keys_still_explain():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: key_bar(app))              # the footer draws its keys a moment later
        shown = key_bar(app)
        assert {"step", "back", "presets", "help", "quit"} <= shown and not shown & LIVE_ONLY
        for key in ("a", "x", "f", "w"):
            await pilot.press(key)
        text = notices(app)
        for why in ("adding a request needs a live engine", "abort needs a live engine",
                    "fork needs a live engine", "a branch needs a live engine"):
            assert why in text


@run_async
async def test_live_key_bar_lists_the_live_controls():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await wait_for(pilot, lambda: LIVE_ONLY <= key_bar(app), timeout=10)  # fails if they never show


@run_async
async def test_a_replay_that_becomes_live_shows_the_live_keys():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.press("p", "enter")                          # the first preset, live
        await wait_for(pilot, lambda: app.source.mode == "live" and app.frame is not None
                       and app.frame.state.model == "tiny-llama")
        await wait_for(pilot, lambda: LIVE_ONLY <= key_bar(app), timeout=10)  # fails if they never show


def test_attach_status_follows_the_server_instead_of_pausing():
    attach = status_text("attach", "http://127.0.0.1:8000", "step 12", False, 2.0).plain
    assert "following the server" in attach and "paused" not in attach and "steps/s" not in attach
    live = status_text("live", "memory-pressure on smollm2", "step 3", False, 2.0).plain
    assert "paused" in live and "2 steps/s" in live


# -- the command palette -------------------------------------------------------------------------


@run_async
async def test_ctrl_p_opens_the_command_palette_with_this_sources_actions():
    from textual.command import CommandPalette

    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        await pilot.press("escape")
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Step back" in titles and "nanoserve help" in titles and "Add a request" not in titles
        assert any("theme" in t.lower() for t in titles)         # Textual's own are there too
        await pilot.press("ctrl+p", *"nanoserve help")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), timeout=5)


def test_help_explains_the_ref_count_mark_and_the_metrics_words():
    from rich.console import Console

    from nanoserve.kv_usage import CACHED, HIT_RATE, USED
    from nanoserve_tui.screens import KEYS, PANELS, help_table
    from nanoserve_tui.widgets.pool import HINT

    console = Console(width=200, record=True, color_system=None)
    console.print(help_table("Keys", KEYS))
    console.print(help_table("Panels", PANELS))
    text = " ".join(console.export_text().split())
    assert "xN, its ref count" in text and "ctrl+p" in text
    for words in (USED, CACHED, HIT_RATE):
        assert " ".join(words.split()) in text
    assert "x6" in HINT.plain and "ref count" in HINT.plain  # under the grid, before a block is selected


# -- dialogs ---------------------------------------------------------------------------------------


@run_async
async def test_branch_dialog_takes_typing_at_once_and_the_header_keeps_the_change():
    app = live_app("memory-pressure")
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)
        await pilot.press("w")
        assert isinstance(app.screen, BranchScreen)
        first = app.screen.query_one("#set-preemption_mode")
        assert app.screen.focused is first                       # typing goes into the first setting
        assert first.value == "recompute"
        await pilot.press(*["backspace"] * len(first.value), *"swap", "enter")
        await wait_for(pilot, lambda: "branched at step 1" in notices(app))
        await wait_for(pilot, lambda: "what if preemption_mode=swap" in status(app))
        await pilot.press("n")                                   # the branch goes on: the header still says it
        await wait_for(pilot, lambda: step_of(app) == 2)
        assert "what if preemption_mode=swap" in status(app)


@run_async
async def test_rewind_says_so_while_it_replays(monkeypatch):
    """`b` on a real model replays the run for seconds: the status line says so at once, and the
    panels are dimmed, until the rewound step arrives."""
    release = threading.Event()
    rewind = Run.rewind

    def slow_rewind(self, k):
        release.wait(30)
        return rewind(self, k)

    monkeypatch.setattr(Run, "rewind", slow_rewind)
    app = live_app("memory-pressure")
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        for step in (1, 2, 3):
            await pilot.press("n")
            await wait_for(pilot, lambda: step_of(app) == step)
        await pilot.press("b")
        await pilot.pause(0.2)
        assert "rewinding to step 2" in status(app) and step_of(app) == 3
        assert app.query_one("#body").has_class("-busy")
        release.set()
        await wait_for(pilot, lambda: step_of(app) == 2)
        await pilot.pause()
        assert "rewinding" not in status(app) and not app.query_one("#body").has_class("-busy")


@run_async
async def test_add_dialog_wraps_the_prompt_in_the_chat_template(tmp_path):
    from serve_helpers import save_chat_model

    path = save_chat_model(tmp_path / "chat-model")
    app = NanoserveApp(LiveSource(model=path))
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("a")
        assert isinstance(app.screen, AddRequestScreen) and app.screen.query_one("#chat").value
        await pilot.press(*"What is 2+2?", "enter")              # the prompt field has focus
        await wait_for(pilot, lambda: "u1" in app.frame.state.sequences)
        assert app.frame.state.sequences["u1"].prompt == "<|user|>What is 2+2?\n<|assistant|>"
        await pilot.press("a")
        await pilot.click("#chat")                               # unticked: the bare text
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")
        await wait_for(pilot, lambda: "u2" in app.frame.state.sequences)
        assert app.frame.state.sequences["u2"].prompt == "Hi"


@run_async
async def test_add_dialog_has_no_chat_option_without_a_template():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("a")
        assert isinstance(app.screen, AddRequestScreen) and not app.screen.query("#chat")
        await pilot.press(*"Hi", "enter")
        await wait_for(pilot, lambda: "u1" in app.frame.state.sequences)
        assert app.frame.state.sequences["u1"].prompt == "Hi"
