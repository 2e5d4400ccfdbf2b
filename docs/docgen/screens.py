"""The TUI's own screenshots (`docs/img/tui-*.svg`): `python docs/generate.py screens`.

Each scenario's SmolLM2 recording (docs/traces/, `traces.py`) is replayed headless at 160×50, and
saved at its showcase step (the memory-pressure one also at 100×30). The tour
page's sentences about the 100×30 layout are checked on that screenshot's text.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from docgen import Result
from docgen.pictures import screen_lines
from docgen.traces import path as shipped
from nanoserve import events as ev
from nanoserve.scenarios import SCENARIOS
from nanoserve.trace import read_trace
from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.screenshots import showcase_step
from nanoserve_tui.source import ReplaySource
from nanoserve_tui.widgets.pool import PoolGrid


async def shoot(trace: Path, step: int, size: tuple[int, int], out: Path, select: str | None = None) -> None:
    """The app's own SVG screenshot at `step` (`select`: show this request's last block), taken once the
    screen has settled: the key bar at the bottom is drawn a refresh or two after the panels."""
    source = ReplaySource.from_path(trace)
    source.position = next(i for i, group in enumerate(source.groups)
                           if any(isinstance(e, ev.StepStarted) and e.step == step for e in group))
    app = NanoserveApp(source)
    async with app.run_test(size=size) as pilot:
        while app.frame is None or app.frame.state.step != step:
            await pilot.pause(0.05)
        if select is not None:
            app.query_one(PoolGrid).selected = app.frame.state.sequences[select].block_table[-1]
        svg = ""
        for _ in range(100):                       # at most ~10 s
            await pilot.pause(0.1)
            svg = app.export_screenshot(title=f"nanoserve tui --replay {trace.name}  (step {step})")
            if "quit" in screen_lines(svg)[-1]:
                break
        out.write_text(svg)


def make(read) -> Result:
    out = Result()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in SCENARIOS:
            trace = shipped(name)
            step = showcase_step(name, read_trace(trace))
            select = {"memory-pressure": "r0", "tensor-parallel": "fork"}.get(name)   # a block to inspect
            shots = {f"tui-{name}.svg": (160, 50)}
            if name == "memory-pressure":
                shots["tui-100x30.svg"] = (100, 30)
            for file, size in shots.items():
                asyncio.run(shoot(trace, step, size, tmp / file, select))
                out.files[f"docs/img/{file}"] = (tmp / file).read_bytes()
    small = "\n".join(screen_lines(out.files["docs/img/tui-100x30.svg"].decode()))
    wide = "\n".join(screen_lines(out.files["docs/img/tui-memory-pressure.svg"].decode()))
    assert "= this step" in wide and "= this step" not in small, "tui.md: the legend gets shorter below 130 columns"
    assert any("free" in line and "request" in line for line in small.splitlines()), "... and stays"
    assert "radix tree" in small, "tui.md says the radix panel stays at 100x30 when the engine caches prefixes"
    return out
