"""The TUI's what-if keys: `b` steps a live engine back (a rewind), `w` branches it with other settings."""

from __future__ import annotations

from test_tui import WIDE, live_app, notices, panels, replay_app, run_async, step_of, wait_for

from nanoserve_tui.screens import BranchScreen


@run_async
async def test_live_back_shows_exactly_the_earlier_step():
    app = live_app("memory-pressure")
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        seen = {0: panels(app)}
        for step in range(1, 5):
            await pilot.press("n")
            await wait_for(pilot, lambda: step_of(app) == step)
            seen[step] = panels(app)
        for step in (3, 2):
            await pilot.press("b")
            await wait_for(pilot, lambda: step_of(app) == step)
            await pilot.pause(0.05)
            assert panels(app) == seen[step], step
        await pilot.press("n")                                   # and forward again: the same step 3
        await wait_for(pilot, lambda: step_of(app) == 3)
        await pilot.pause(0.05)
        assert panels(app) == seen[3]


@run_async
async def test_branch_dialog_changes_a_setting_from_here():
    app = live_app("memory-pressure")
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        for step in range(1, 4):
            await pilot.press("n")
            await wait_for(pilot, lambda: step_of(app) == step)
        await pilot.press("w")
        assert isinstance(app.screen, BranchScreen)
        assert app.screen.query_one("#set-preemption_mode").value == "recompute"
        app.screen.query_one("#set-block_size").value = "zero"
        await pilot.click("#branch")
        assert isinstance(app.screen, BranchScreen)              # refused, with the reason
        assert "block_size is not a whole number" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#set-block_size").value = "4"
        app.screen.query_one("#set-preemption_mode").value = "swap"
        app.screen.query_one("#set-preemption_mode").focus()
        await pilot.press("enter")
        assert not isinstance(app.screen, BranchScreen)
        await wait_for(pilot, lambda: "branched at step 3" in notices(app))
        assert "preemption_mode=swap" in notices(app) and "the same steps so far" in notices(app)
        assert step_of(app) == 3 and app.frame.state.num_cpu_blocks > 0
        assert app.source.settings["preemption_mode"] == "swap"
        app.speed = 5
        await pilot.press("r")                                   # the branch runs on, and swaps
        await wait_for(pilot, lambda: app.frame.at_end or app.frame.state.swapped, timeout=60)
        await pilot.press("r")                                   # pause before the app closes
        await wait_for(pilot, lambda: not app.source._pending_steps)


@run_async
async def test_branch_needs_a_live_engine():
    app = replay_app()
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.frame is not None)
        await pilot.press("w")
        assert not isinstance(app.screen, BranchScreen)
        assert "a branch needs a live engine" in notices(app)
