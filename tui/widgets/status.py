"""The status line at the top: mode, what is running, step, running/paused, speed, and the code that runs.

The last part says which implementation computes the steps (the engine's
`implementation`, from the trace's EngineSynced): "fast path: CpuLlama ·
attention cpu · matmul panels" by default on a CPU, "reading path: Llama ·
attention torch · matmul torch" with `fast_paths=False`. On a narrow screen
it is cut first.

A `Static` with a fixed height, updated without a layout pass: the step
number changes every step, and re-laying out the screen for it would cost
more than drawing the step.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

MODE_STYLE = {"live": "bold #000000 on #98c379", "replay": "bold #000000 on #61afef",
              "attach": "bold #000000 on #c678dd"}


class StatusBar(Static):
    def show(self, mode: str, description: str, position: str, playing: bool, speed: float,
             implementation: str = "") -> None:
        text = Text.assemble(
            (" nanoserve ", "bold"), (f" {mode.upper()} ", MODE_STYLE.get(mode, "reverse")),
            f"  {description}  ", (position, "bold"), "  ",
            ("running" if playing else "paused", "bold #98c379" if playing else "#e5c07b"),
            f"  {speed:g} steps/s",
        )
        if implementation:
            text.append(f"  ·  {implementation}", style="dim")
        text.no_wrap, text.overflow = True, "ellipsis"
        self.update(text, layout=False)
