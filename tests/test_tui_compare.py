"""`nanoserve compare --tui`: two runs side by side in lockstep, with a difference panel."""

from __future__ import annotations

import io

import pytest
from test_tui import WIDE, run_async

from nanoserve.whatif.compare import compare
from nanoserve.whatif.workload import scenario_pair
from nanoserve_tui.compare_app import CompareApp, row_at
from nanoserve_tui.widgets.pool import PoolPanel


@pytest.fixture(scope="module")
def pair(tiny_llama):
    return scenario_pair("memory-pressure", {"preemption_mode": "swap"}, tiny_llama.name, tiny_llama)


def _text(app, selector: str) -> str:
    """What a Static shows, as plain text."""
    from rich.console import Console

    console = Console(width=160, record=True, color_system=None, file=io.StringIO())
    console.print(app.query_one(selector).content)
    return console.export_text()


@run_async
async def test_both_sides_step_together_and_the_panel_follows(pair):
    a, b = pair
    c = compare(a, b)
    app = CompareApp(c, a.events, b.events)
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        assert "they diverge at step" in _text(app, "#headline")
        await pilot.press("n", "n", "n")
        states = [app.query_one(f"#pool-{i}", PoolPanel).state for i in (0, 1)]
        assert [s.step for s in states] == [3, 3]
        assert states[0].free_queue == states[1].free_queue          # before the divergence: one run
        await pilot.press("d")
        first = c.first_divergence
        assert app.step == first and f"diverged at step {first} ◆ this step" in _text(app, "#headline")
        await pilot.press("end")
        a_end, b_end = row_at(c.a, app.step), row_at(c.b, app.step)
        panel = _text(app, "#difference")
        swaps = next(line for line in panel.splitlines() if line.strip().startswith("swaps")).split()
        assert swaps[1:3] == [str(a_end.swaps), str(b_end.swaps)] and a_end.swaps < b_end.swaps
        await pilot.press("b")
        assert app.step == app.last - 1


@run_async
async def test_ctrl_p_opens_the_command_palette(pair):
    from textual.command import CommandPalette

    a, b = pair
    app = CompareApp(compare(a, b), a.events, b.events)
    async with app.run_test(size=WIDE) as pilot:
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        await pilot.press(*"First divergence")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert app.step == app.comparison.first_divergence
