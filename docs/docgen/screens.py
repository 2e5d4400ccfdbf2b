"""The TUI's own screenshots (`docs/img/tui-*.svg`), shot the way `nanoserve_tui.screenshots` shoots them.

Each scenario is recorded on tiny-llama, replayed headless at 160×50, and
saved at its showcase step (the memory-pressure one also at 100×30). The tour
page's sentences about the 100×30 layout are checked on that screenshot's text.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from nanoserve.scenarios import SCENARIOS, record
from nanoserve.trace import read_trace
from nanoserve_tui.screenshots import shoot, showcase_step

from docgen import Result
from docgen.pictures import screen_lines


def make(read) -> Result:
    out = Result()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in SCENARIOS:
            trace = tmp / f"{name}.jsonl"
            record(name, trace)
            step = showcase_step(name, read_trace(trace))
            select = "r0" if name == "memory-pressure" else None
            shots = {f"tui-{name}.svg": (160, 50)}
            if name == "memory-pressure":
                shots["tui-100x30.svg"] = (100, 30)
            for file, size in shots.items():
                asyncio.run(shoot(trace, step, size, tmp / file, select))
                out.files[f"docs/img/{file}"] = (tmp / file).read_bytes()
    small = "\n".join(screen_lines(out.files["docs/img/tui-100x30.svg"].decode()))
    wide = "\n".join(screen_lines(out.files["docs/img/tui-memory-pressure.svg"].decode()))
    assert "touched this step" in wide and "touched this step" not in small, \
        "tui.md says the pool's legend is hidden below 130 columns"
    assert "radix tree" in small, "tui.md says the radix panel stays at 100x30 when the engine caches prefixes"
    return out
