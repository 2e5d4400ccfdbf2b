"""The Textual TUI: every control in both modes (Pilot), screenshots (snapshots),
replay == live, and bad input.

Replay tests use a committed trace (tests/data/tui-memory-pressure.jsonl,
recorded with `nanoserve record --scenario memory-pressure`), so they need
no model. Live tests run tiny-llama (random weights, seeded) on the app's
worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from memory_events import memory_trace

from nanoserve.events import EngineSynced, StepFinished, StepStarted
from nanoserve.scenarios import SCENARIOS
from nanoserve.trace import fold_all, read_trace
from nanoserve_tui.app import NanoserveApp, run_app
from nanoserve_tui.live_source import LiveSource
from nanoserve_tui.screens import AddRequestScreen, HelpScreen, ScenarioPicker
from nanoserve_tui.source import ReplaySource, split_steps
from nanoserve_tui.widgets.event_log import EventLog
from nanoserve_tui.widgets.free_queue import FreeQueue
from nanoserve_tui.widgets.pool import PoolGrid, describe_block, grid_layout
from nanoserve_tui.widgets.radix import RadixTree
from nanoserve_tui.widgets.requests import RequestList
from nanoserve_tui.widgets.tables import BlockTables

TRACE = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"
PREEMPT_STEP = 13    # in that trace, r2 is preempted at step 13 (r3 was at step 5)
WIDE, NARROW = (160, 50), (100, 30)


def run_async(test):
    """Run an async test with asyncio (no pytest async plugin needed); fixtures still work."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return wrapper


def replay_app() -> NanoserveApp:
    return NanoserveApp(ReplaySource.from_path(TRACE))


async def wait_for(pilot, condition, timeout: float = 30.0) -> None:
    """Let the app run until `condition()` holds (live steps happen on a worker thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


def step_of(app: NanoserveApp) -> int:
    return app.frame.state.step


def notices(app: NanoserveApp) -> str:
    return "\n".join(str(n.message) for n in app._notifications)


def panels(app: NanoserveApp) -> dict[str, str]:
    """What the data panels show, as plain text."""
    return {
        "pool": app.query_one(PoolGrid).text,
        "block": str(app.query_one("#block-info").render()),
        "tables": app.query_one(BlockTables).text,
        "free": app.query_one(FreeQueue).text,
        "requests": app.query_one(RequestList).text,
        "events": app.query_one(EventLog).text,
        "metrics": " | ".join(str(app.query_one(f"#{k}-label").render()) for k in ("tokens", "kv", "accept", "hit")),
        "radix": app.query_one(RadixTree).text,
    }


# -- sources without an app -----------------------------------------------------------


def test_split_steps_and_replay_frames_match_fold():
    events = read_trace(TRACE)
    groups = split_steps(events)
    assert isinstance(groups[0][0], EngineSynced)
    assert all(isinstance(g[0], StepStarted) or g is groups[0] for g in groups)
    assert all(isinstance(g[-1], StepFinished) for g in groups[1:])
    source = ReplaySource(events)
    last = source.frame(source.last)
    assert last.at_end and last.state == fold_all(events)
    assert source.frame(3).state.step == 3 and not source.frame(3).at_end


def test_replay_frames_in_any_order_match_fold_with_few_kept(monkeypatch):
    """Only every CHECKPOINT-th frame and the RECENT last are kept; any frame, asked for in any order,
    is the fold of the trace up to it, the same object while it is kept, and its steps are source.steps()."""
    import random

    from nanoserve_tui import source as source_module

    monkeypatch.setattr(source_module, "CHECKPOINT", 4)
    monkeypatch.setattr(source_module, "RECENT", 2)
    events = read_trace(TRACE)
    groups = split_steps(events)
    source = ReplaySource(events)
    order = list(range(len(groups))) * 2
    random.Random(0).shuffle(order)
    for i in order:
        frame = source.frame(i)
        assert frame is source.frame(i)
        assert frame.state == fold_all([e for g in groups[:i + 1] for e in g]), i
        assert frame.state.step == source.steps()[i]
    kept = len(source._frames)
    assert kept <= len(groups) // 4 + 1 + 2


def test_grid_layout_gets_more_detailed_with_room():
    assert grid_layout(20, 4, 76, 40).lines == 3          # id / owner / fill
    assert grid_layout(20, 4, 46, 9).lines == 2
    assert grid_layout(96, 8, 46, 8).lines == 1
    assert grid_layout(4096, 16, 76, 20).lines == 0       # one character per block


def test_describe_block_lists_owner_and_token_positions():
    state = ReplaySource(read_trace(TRACE)).frame(PREEMPT_STEP).state
    text = describe_block(state, state.sequences["r1"].block_table[-1]).plain
    assert "ref count 1" in text and "r1" in text and "tokens 24-25 (2/4)" in text
    free = state.free_queue[0]
    assert "free · position 0" in describe_block(state, free).plain


# -- replay controls --------------------------------------------------------------------


@run_async
async def test_replay_step_forward_and_back():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        assert step_of(app) == 0 and app.source.mode == "replay"
        await pilot.press("space")
        await pilot.press("n")
        assert step_of(app) == 2
        await pilot.press("b")
        assert step_of(app) == 1
        await pilot.press("left")
        assert step_of(app) == 0
        await pilot.press("b")
        assert "already at the start" in notices(app)


@run_async
async def test_replay_end_of_trace_notice():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(app.source.last)
        await pilot.pause()
        assert app.frame.at_end
        await pilot.press("n")
        assert "end of the trace" in notices(app)


@run_async
async def test_replay_run_pause_and_speed():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        await pilot.press("plus", "plus", "plus")          # 2 -> 4 -> 8 -> 16 steps/s
        assert app.speed == 5
        await pilot.press("plus")                          # already the fastest
        assert app.speed == 5
        await pilot.press("r")
        assert app.playing
        await wait_for(pilot, lambda: step_of(app) >= 3, timeout=10)
        await pilot.press("r")
        assert not app.playing
        stopped = step_of(app)
        await pilot.pause(0.3)
        assert step_of(app) == stopped
        await pilot.press("minus", "minus")
        assert app.speed == 3
        assert "paused" in str(app.query_one("#status").render()) and "4 steps/s" in str(app.query_one("#status").render())


@run_async
async def test_replay_runs_to_the_end_and_pauses():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(app.source.last - 2)
        app.speed = 5
        await pilot.press("r")
        await wait_for(pilot, lambda: not app.playing, timeout=10)
        assert app.frame.at_end


@run_async
async def test_replay_live_only_controls_notify():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        await pilot.press("a")
        assert not isinstance(app.screen, AddRequestScreen)
        await pilot.press("x")
        text = notices(app)
        assert "adding a request needs a live engine" in text
        assert "abort needs a live engine" in text


@run_async
async def test_request_selection_and_fork_in_a_replay():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(5)
        await pilot.pause()
        await pilot.click("#requests", offset=(4, 2))      # inside the border: line 1, the first request
        assert app.query_one(RequestList).selected == "r0"
        await pilot.press("down")                          # the list has focus now: next request
        assert app.query_one(RequestList).selected == "r1"
        await pilot.press("f")
        assert "fork needs a live engine" in notices(app)


@run_async
async def test_block_selection_by_click_and_keys():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(5)
        await pilot.pause()
        grid = app.query_one(PoolGrid)
        cell = grid.layout_.cell
        await pilot.click("#pool-grid", offset=(cell + 2, 0))   # the second cell: block 1
        assert grid.selected == 1
        info = str(app.query_one("#block-info").render())
        assert "block 1" in info and "r0" in info and "tokens 4-7 (4/4)" in info
        await pilot.press("right")                               # the grid has focus after the click
        assert grid.selected == 2
        await pilot.press("down")
        assert grid.selected == 2 + grid.layout_.cols
        app.source.goto(6)                                       # the selection survives a step
        await pilot.pause()
        assert f"block {grid.selected}" in str(app.query_one("#block-info").render())


@run_async
async def test_help_screen_opens_and_closes():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@run_async
async def test_presets_picker_lists_scenarios():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.press("p")
        assert isinstance(app.screen, ScenarioPicker)
        options = app.screen.query_one("#scenarios")
        assert [options.get_option_at_index(i).id for i in range(options.option_count)] == list(SCENARIOS)
        await pilot.press("escape")
        assert not isinstance(app.screen, ScenarioPicker) and app.source.mode == "replay"


# -- live controls ----------------------------------------------------------------------


def live_app(scenario: str = "continuous-batching", **kwargs) -> NanoserveApp:
    return NanoserveApp(LiveSource(scenario=scenario, **kwargs))


@run_async
async def test_live_step_run_pause_and_back_notice():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        assert step_of(app) == 0 and app.source.mode == "live"
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)
        assert set(app.frame.state.running) == {"r1", "r2"}
        await pilot.press("space")
        await wait_for(pilot, lambda: step_of(app) == 2)
        await pilot.press("b")                                    # live too: a rewind (test_tui_whatif.py)
        await wait_for(pilot, lambda: step_of(app) == 1)
        app.speed = 5
        await pilot.press("r")
        await wait_for(pilot, lambda: step_of(app) >= 4)
        await pilot.press("r")
        await wait_for(pilot, lambda: not app.source._pending_steps)
        stopped = step_of(app)
        await pilot.pause(0.4)
        assert step_of(app) == stopped


@run_async
async def test_live_add_request_dialog():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("a")
        assert isinstance(app.screen, AddRequestScreen)
        await pilot.click("#prompt")
        await pilot.press(*"Hi there")
        app.screen.query_one("#max-tokens").value = "0"
        await pilot.click("#add")
        assert isinstance(app.screen, AddRequestScreen)            # rejected: max_tokens < 1
        assert "at least 1" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#max-tokens").value = "5"
        app.screen.query_one("#temperature").value = "0"
        await pilot.click("#prompt")
        await pilot.press("enter")
        assert not isinstance(app.screen, AddRequestScreen)
        await wait_for(pilot, lambda: "u1" in app.frame.state.sequences)
        req = app.frame.state.sequences["u1"]
        assert (req.prompt, req.max_tokens, req.status) == ("Hi there", 5, "waiting")
        before = list(app.frame.state.sequences)                   # the scenario's first arrivals and u1
        assert before[-1] == "u1"
        await pilot.press("a", "escape")                          # cancel adds nothing
        await pilot.pause()
        assert list(app.frame.state.sequences) == before


@run_async
async def test_live_abort_selected_request():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)
        app.query_one(RequestList).selected = "r2"
        await pilot.press("x")
        await wait_for(pilot, lambda: "r2" in app.frame.state.finished)
        state = app.frame.state
        assert state.sequences["r2"].status == "finished_aborted" and not state.sequences["r2"].block_table
        assert "SequenceAborted" in app.query_one(EventLog).text
        await pilot.press("x")                                    # already finished
        assert "r2 has already finished" in notices(app)


@run_async
async def test_live_fork_selected_request():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        app.query_one(RequestList).selected = "r1"
        await pilot.press("f")                                    # still waiting: the engine says why not
        await wait_for(pilot, lambda: "only a running request that has started generating" in notices(app))
        for n in (1, 2, 3):
            await pilot.press("n")
            await wait_for(pilot, lambda: step_of(app) == n)
        assert app.frame.state.sequences["r1"].num_output_tokens > 0
        await pilot.press("f")
        await wait_for(pilot, lambda: "r1.1" in app.frame.state.sequences)
        state = app.frame.state
        assert state.sequences["r1.1"].block_table == state.sequences["r1"].block_table
        assert "r1.1" in state.running and "Forked" in app.query_one(EventLog).text
        await wait_for(pilot, lambda: "r1.1 shares its blocks" in notices(app))
        app.query_one(RequestList).selected = "r2"
        await pilot.press("x")
        await wait_for(pilot, lambda: "r2" in app.frame.state.finished)
        await pilot.press("f")                                    # a finished request: a notice, no crash
        await wait_for(pilot, lambda: "request 'r2' has already finished" in notices(app))
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 4)


@run_async
async def test_live_presets_restart_engine():
    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)
        await pilot.press("p")
        assert isinstance(app.screen, ScenarioPicker)
        await pilot.press("down", "enter")                        # the second preset: memory-pressure
        await wait_for(pilot, lambda: app.frame.state.num_blocks == 20)
        assert step_of(app) == 0 and app.source.description.startswith("memory-pressure")
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)
        assert len(app.frame.state.sequences) == 5


@run_async
async def test_live_restart_that_fails_keeps_the_old_engine_on_screen(monkeypatch):
    """Regression: the old engine was unsubscribed before the new one was built; when building
    failed, the view froze while the worker went on stepping the old engine."""
    import nanoserve_tui.live_source as source_module

    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)

        def no_room(*args, **kwargs):
            raise RuntimeError("out of memory building the engine")

        monkeypatch.setattr(source_module, "scenario_start", no_room)
        await pilot.press("p", "down", "enter")                  # memory-pressure: fails to build
        await wait_for(pilot, lambda: "out of memory building the engine" in notices(app))
        await pilot.press("n")                                    # the old engine still steps, on screen
        await wait_for(pilot, lambda: step_of(app) == 2)
        assert app.frame.state.num_blocks == 64 and app.source.description.startswith("continuous-batching")


@run_async
async def test_live_view_that_cannot_fold_restarts_from_the_engine(monkeypatch):
    """Regression: a fold error on the UI thread escaped the error handling; now it is a notice and
    the view starts afresh from an EngineSynced of the engine's state."""
    import nanoserve_tui.live_source as source_module

    app = live_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        fold, broken = source_module.fold, []

        def fold_that_fails_once(state, event):
            if isinstance(event, StepFinished) and not broken:
                broken.append(event)
                raise ValueError("a viewer bug")
            return fold(state, event)

        monkeypatch.setattr(source_module, "fold", fold_that_fails_once)
        await pilot.press("n")
        await wait_for(pilot, lambda: "a viewer bug" in notices(app))
        await wait_for(pilot, lambda: step_of(app) == 1)          # resynced: the state after step 1
        assert set(app.frame.state.running) == {"r1", "r2"}
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 2)


@run_async
async def test_replay_preset_starts_a_live_run():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.press("p", "enter")                           # the first preset
        await wait_for(pilot, lambda: app.source.mode == "live" and app.frame.state.model == "tiny-llama"
                       and app.frame.state.num_blocks == 64)


@run_async
async def test_live_model_directory_loads_inside_the_app(tiny_llama_dir):
    """A model directory goes through the real loader (and its progress line) on the worker thread."""
    app = NanoserveApp(LiveSource(model=tiny_llama_dir, scenario="continuous-batching"))
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None or app.error is not None, timeout=60)
        assert app.error is None and app.frame.state.model == tiny_llama_dir
        await pilot.press("n")
        await wait_for(pilot, lambda: step_of(app) == 1)


@run_async
async def test_live_model_that_fails_to_load():
    app = NanoserveApp(LiveSource(model="/no/such/model"))
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.error is not None)
        assert "could not load model '/no/such/model'" in app.error
        assert "press q to quit" in str(app.query_one("#error-message").render())
        await pilot.press("n")
        assert "did not load" in notices(app)
        await pilot.press("q")
    assert app.return_code == 2


# -- replay gives the same screens as the live run --------------------------------------


@run_async
async def test_replay_matches_live_run(tmp_path):
    recording = tmp_path / "live.jsonl"
    live = live_app("memory-pressure", record=recording)
    async with live.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: live.frame is not None)
        for steps in range(1, 30):                                # up to the first preemption
            await pilot.press("n")
            await wait_for(pilot, lambda: step_of(live) == steps)
            if "Preempted" in live.query_one(EventLog).text:
                break
        live.query_one(PoolGrid).selected = 3
        await pilot.pause()
        seen_live = panels(live)
    replay = NanoserveApp(ReplaySource.from_path(recording))
    async with replay.run_test(size=WIDE) as pilot:
        replay.source.goto(steps)
        replay.query_one(PoolGrid).selected = 3
        await pilot.pause()
        seen_replay = panels(replay)
    assert "Preempted" in seen_live["events"] or "preempted" in seen_live["tables"]
    for name in seen_live:
        assert seen_replay[name] == seen_live[name], name


# -- memory mechanisms (a hand-written trace: tests/memory_events.py) ------------------------


def memory_app() -> NanoserveApp:
    return NanoserveApp(ReplaySource(memory_trace(), name="memory-synthetic"))


@run_async
async def test_radix_tree_panel_follows_the_trace():
    app = memory_app()
    async with app.run_test(size=WIDE) as pilot:
        tree = app.query_one(RadixTree)
        await pilot.pause()
        assert "empty: nothing cached yet" in tree.text
        app.source.goto(3)
        await pilot.pause()
        assert tree.text.splitlines() == [
            "root 3 nodes, 4 blocks · hit 38%",
            "  “You are a helpful bot.” lock 3 [0 1] @3",
            "    “ Hi Hello x” lock 1 [2] @3",
            "    “ Tell me” lock 2 [3] @3",
        ]
        new = [n for n in tree.root.children[0].children]
        assert all("on #98c379" in str(n.label.style) for n in new)      # inserted this step
        app.source.goto(5)
        await pilot.pause()
        lines = tree.text.splitlines()
        assert lines[1] == "  “You are ” lock 2 [0] @5" and "evicted [2]" in lines[-1]
        assert "on #e5c07b" in str(tree.root.children[0].label.style)    # hit this step
        text = panels(app)
        assert "SWAPPED (0)" in text["requests"] and "pruned" in text["requests"]
        assert "cache hit 44%" in text["metrics"] and app.query_one("#hit-metric").display
        assert not app.query_one("#accept-metric").display
        assert "RadixSplit" in text["events"] and "node 1 cut after 1 blocks" in text["events"]


@run_async
async def test_swap_shows_in_queues_tables_and_cpu_strip():
    app = memory_app()
    async with app.run_test(size=WIDE) as pilot:
        app.source.goto(4)
        await pilot.pause()
        text = panels(app)
        assert "SWAPPED (1)" in text["requests"] and "KV 12 on CPU" in text["requests"]
        assert "on CPU c0 c1 c2" in text["tables"] and "0→0*" in text["tables"]
        assert str(app.query_one("#cpu-pool").render()).startswith("CPU swap 3/6")
        assert "cached" in app.query_one("#pool-panel").border_subtitle
        lines = text["pool"].splitlines()
        assert lines[0].split()[:4] == ["0", "1", "2", "3"] and lines[1].split()[:4] == ["x3", "x3", "cache", "x3"]
        info = describe_block(app.frame.state, 2).plain
        assert "in radix node 2" in info and "unlocked: evictable" in info


@run_async
async def test_radix_tree_is_cut_for_big_caches():
    from textual.app import App

    from nanoserve.trace import RadixNodeView, ViewState
    from nanoserve_tui.widgets.radix import MAX_NODES

    class One(App):
        def compose(self):
            yield RadixTree()

    state = ViewState(1, "m", 8, 4, [0] * 8, list(range(8)), prefix_caching=True)
    for i in range(1, MAX_NODES + 31):
        state.radix[i] = RadixNodeView(i, 0, f"span {i}", 4, [], i)
        state.radix[0].children.append(i)
    app = One()
    async with app.run_test(size=WIDE) as pilot:
        app.query_one(RadixTree).state = state
        await pilot.pause()
        lines = app.query_one(RadixTree).text.splitlines()
        assert len(lines) == 1 + MAX_NODES + 1 and lines[-1].strip() == "… 30 more nodes"


def test_memory_replay_frames_match_fold():
    events = memory_trace()
    source = ReplaySource(events)
    assert source.frame(source.last).state == fold_all(events) and source.final_step == 6


# -- displays that do not mislead ----------------------------------------------------------


def test_bars_are_measured_from_zero_on_a_fixed_scale():
    from nanoserve_tui.widgets.metrics import bar_rows

    assert bar_rows([1, 50, 100], 100, 3, 1) == [" ▄█"]          # 1 % is (almost) nothing, 100 % is full
    assert bar_rows([1, 1, 1], 100, 3, 2) == ["   ", "   "]      # a flat 1 % does not fill the height
    assert bar_rows([50], 100, 3, 2) == ["   ", "█  "]           # one column per step, oldest first


def test_legend_and_help_say_what_they_mean():
    from rich.console import Console

    from nanoserve_tui.screens import PANELS, help_table
    from nanoserve_tui.widgets.block_info import legend

    key = legend(ReplaySource(read_trace(TRACE)).frame(3).state).plain
    assert "underlined = this step" in key and not any(c.isdigit() for c in key)   # a sample, not a count
    console = Console(width=200, record=True, color_system=None)
    console.print(help_table("Panels", PANELS))
    text = console.export_text()
    assert "eviction frees them); [blocks]; @step" in text and "; ;" not in text


def test_event_log_shows_newlines_and_empty_tokens_one_way():
    from nanoserve.events import TokenSampled
    from nanoserve_tui.widgets.event_log import describe

    assert describe(TokenSampled(1, "r1", 198, "\n", -0.5)) == "r1 token 198 '⏎' logprob -0.50"
    assert describe(TokenSampled(1, "r1", 2, "", -0.1)) == "r1 token 2 ⟨no text⟩ logprob -0.10"


def fits(strip_or_text, width: int) -> bool:
    return (getattr(strip_or_text, "cell_length", None) or strip_or_text.cell_len) <= width


@run_async
async def test_narrow_screen_cuts_nothing():
    """100x30: request lines, radix labels, panel titles, metric labels and the presets all fit."""
    from nanoserve_tui.widgets.radix import evicted_label, node_label, root_label
    from nanoserve_tui.widgets.requests import request_lines

    app = memory_app()
    async with app.run_test(size=NARROW) as pilot:
        app.source.goto(5)
        await pilot.pause()
        state = app.frame.state
        requests = app.query_one(RequestList)
        width = requests.scrollable_content_region.width
        for rid in state.sequences:
            first, _ = request_lines(state, rid, "#ffffff", width)
            assert first.text.rstrip().endswith(str(state.sequences[rid].num_computed_tokens) + (
                " on CPU" if state.sequences[rid].cpu_block_table else "")), first.text
        tree = app.query_one(RadixTree)
        room = tree.scrollable_content_region.width
        assert fits(root_label(state, room - 3), room - 3)
        locks = state.lock_counts()
        for node in state.radix_nodes():
            indent = 2 * len(state.radix_path(node.node_id)) + 2
            assert fits(node_label(state, node, locks[node.node_id], room - indent - 1), room - indent - 1)
        assert state.evicted_nodes
        for node in state.evicted_nodes.values():
            indent = 2 * (len(state.radix_path(node.parent_id)) + 1) + 2
            label = evicted_label(node, room - indent - 1)
            assert fits(label, room - indent - 1) and "evicted" in label.plain
        for panel in app.query(".panel"):
            assert len(panel.border_title or "") + 6 <= panel.size.width, panel.border_title
        for key in ("tokens", "kv", "hit"):
            label = app.query_one(f"#{key}-label")
            assert len(str(label.render())) <= label.size.width, str(label.render())
        await pilot.press("p")
        options = app.screen.query_one("#scenarios")
        await pilot.pause()
        assert options.max_scroll_y == 0 and options.option_count == len(SCENARIOS)   # all of them, no scrolling


@pytest.mark.parametrize("size", [WIDE, NARROW])
def test_notices_do_not_cover_the_metrics(size):
    from textual.widgets._toast import Toast

    async def run():
        app = replay_app()
        async with app.run_test(size=size, notifications=True) as pilot:
            await pilot.pause()
            for n in range(3):
                app.notify(f"notice {n}", timeout=30)
            await pilot.pause(0.3)
            metrics = app.query_one("#metrics").region
            toasts = list(app.screen.query(Toast))
            assert toasts and not any(t.region.overlaps(metrics) for t in toasts)

    asyncio.run(run())


# -- screenshots ------------------------------------------------------------------------


async def _at_preemption(pilot) -> None:
    pilot.app.source.goto(PREEMPT_STEP)
    await pilot.pause()


def test_snapshot_wide(snap_compare):
    assert snap_compare(replay_app(), terminal_size=WIDE, run_before=_at_preemption)


def test_snapshot_narrow(snap_compare):
    assert snap_compare(replay_app(), terminal_size=NARROW, run_before=_at_preemption)


async def _at_memory_step(pilot) -> None:
    pilot.app.source.goto(5)          # a split, a hit, an eviction, a pruned beam, a swap-in
    await pilot.pause()


def test_snapshot_memory_wide(snap_compare):
    assert snap_compare(memory_app(), terminal_size=WIDE, run_before=_at_memory_step)


def test_snapshot_memory_narrow(snap_compare):
    assert snap_compare(memory_app(), terminal_size=NARROW, run_before=_at_memory_step)


# -- bad input ---------------------------------------------------------------------------


def test_run_app_missing_trace(tmp_path, capsys):
    assert run_app(replay=str(tmp_path / "nope.jsonl")) == 2
    err = capsys.readouterr().err
    assert "trace not found" in err and "nope.jsonl" in err and "Traceback" not in err


def test_run_app_corrupt_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = TRACE.read_text().splitlines()
    bad.write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]))
    assert run_app(replay=str(bad)) == 2
    assert f"{bad}:4:" in capsys.readouterr().err


def test_run_app_trace_without_engine_synced(tmp_path, capsys):
    bad = tmp_path / "headless.jsonl"
    bad.write_text("\n".join(TRACE.read_text().splitlines()[1:]))
    assert run_app(replay=str(bad)) == 2
    assert "must start with EngineSynced" in capsys.readouterr().err


def test_run_app_unknown_scenario(capsys):
    assert run_app(scenario="no-such-scenario") == 2
    err = capsys.readouterr().err
    assert "unknown scenario 'no-such-scenario'" in err and "memory-pressure" in err


def test_every_event_type_has_a_colour_and_its_own_line_in_the_event_log():
    """A new event type must get a line that says what happened, not the fallback's bare field dump."""
    import nanoserve.events as ev
    from nanoserve_tui.widgets.event_log import COLOURS, describe

    types = [c for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.Event) and c is not ev.Event]
    assert sorted(t.__name__ for t in types) == sorted(COLOURS)
    free = ev.TokenConstrained(4, "r1", 17, 12, 257, True, False)
    forced = ev.TokenConstrained(4, "r1", 93, 1, 257, False, True)
    assert describe(free) == "r1 grammar allowed 12/257 tokens, masked the model's top choice; drew 17"
    assert describe(forced) == "r1 grammar allowed only token 93: forced, the model had no say"
