"""The status line at the top: mode, what is running, step, running/paused, speed, and the code that runs.

The last part says which implementation computes the steps (the engine's
`implementation`, from the trace's EngineSynced): "fast path: CpuLlama ·
attention cpu · matmul panels" by default on a CPU, "reading path: Llama ·
attention torch · matmul torch" with `path="reading"`. On a narrow screen
it is cut first.

    nanoserve  LIVE   memory-pressure on smollm2  what if preemption_mode=swap  step 31  paused  2 steps/s

After a branch (`w`) the settings it changed follow the run's name, so the
screen says which run this is. While a rewind or branch replays the run the
step gives way to what is being replayed. Attached to a server, the view
follows the server's own steps: no run/pause, no speed.

A `Static` with a fixed height, updated without a layout pass: the step
number changes every step, and re-laying out the screen for it would cost
more than drawing the step.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

MODE_STYLE = {"live": "bold #000000 on #98c379", "replay": "bold #000000 on #61afef",
              "attach": "bold #000000 on #c678dd"}
CHANGES = "bold #000000 on #e5c07b"   # a branch's changed settings
BUSY = "bold #e5c07b"


def status_text(mode: str, description: str, position: str, playing: bool, speed: float,
                changes: dict | None = None, busy: str | None = None) -> Text:
    """The status line's text (a plain function: tests read it without an app)."""
    text = Text.assemble((" nanoserve ", "bold"), (f" {mode.upper()} ", MODE_STYLE.get(mode, "reverse")),
                         f"  {description}  ")
    if changes:
        text.append(" what if " + " ".join(f"{k}={v}" for k, v in changes.items()) + " ", CHANGES)
        text.append("  ")
    if busy is not None:
        return text.append_text(Text.assemble((f"{position} → ", "bold"), (busy, BUSY)))
    text.append(position, "bold")
    if mode == "attach":   # the server steps by itself: the view follows it
        return text.append_text(Text.assemble("  ", ("following the server", "bold #98c379")))
    return text.append_text(Text.assemble(
        "  ", ("running" if playing else "paused", "bold #98c379" if playing else "#e5c07b"),
        f"  {speed:g} steps/s"))


class StatusBar(Static):
    def show(self, mode: str, description: str, position: str, playing: bool, speed: float,
             changes: dict | None = None, busy: str | None = None, implementation: str = "") -> None:
        text = status_text(mode, description, position, playing, speed, changes, busy)
        if implementation:    # what computes the steps; cut first on a narrow screen
            text.append(f"  ·  {implementation}", style="dim")
        text.no_wrap, text.overflow = True, "ellipsis"
        self.update(text, layout=False)
