"""Metrics over time: Textual `Sparkline`s from `ViewState.history`.

Tokens computed per step (prefill + decode), KV pool usage, and, with
speculative decoding, the share of drafted tokens the target accepted
("accepted"). A sparkline spans its data's min..max; the label has the value.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline

from nanoserve_tui.source import Frame


def series(frame: Frame) -> dict[str, tuple[str, list[float]]]:
    """Metric id -> (label with the latest value, values per step)."""
    state = frame.state
    tokens = [p + d for _, p, d, _, _ in state.history]
    used = [100 * (state.num_blocks - free) / state.num_blocks for _, _, _, free, _ in state.history]
    accepted = [100 * r for r in frame.acceptance]
    return {
        "tokens": (f"tokens/step {tokens[-1] if tokens else '–'}", tokens),
        "kv": (f"KV used {used[-1]:.0f}%" if used else "KV used –", used),
        "accept": (f"accepted {accepted[-1]:.0f}%" if accepted else "accepted –",
                   accepted),
    }


class Metrics(Horizontal):
    frame: reactive[Frame | None] = reactive(None, always_update=True)

    def compose(self) -> ComposeResult:
        for key in ("tokens", "kv", "accept"):
            with Vertical(classes="metric"):
                yield Label("", id=f"{key}-label")
                yield Sparkline([], id=f"{key}-spark")

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        for key, (label, values) in series(frame).items():
            self.query_one(f"#{key}-label", Label).update(label, layout=False)   # fixed size: repaint only
            self.query_one(f"#{key}-spark", Sparkline).data = values[-200:]
