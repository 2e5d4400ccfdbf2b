"""Metrics over time: Textual `Sparkline`s from `ViewState.history`.

Tokens computed per step (prefill + decode, and per second of that step's
time), KV pool usage, with speculative decoding the share of drafted tokens
the target accepted ("accepted", shown once drafts were verified), and with
prefix caching the cache hit rate (prompt tokens whose KV came from the
cache / tokens looked up, over the run so far). A sparkline spans
its data's min..max; the label has the value.
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
    seconds = [dur for *_, dur in state.history]
    rate = ""
    if tokens and seconds[-1] > 0:
        per_s = tokens[-1] / seconds[-1]
        rate = f"{per_s / 1000:.1f}k" if per_s >= 1000 else f"{per_s:.0f}"
    used = [100 * (state.num_blocks - free) / state.num_blocks for _, _, _, free, _ in state.history]
    accepted = [100 * r for r in frame.acceptance]
    hits = [100 * hit / looked_up for _, hit, looked_up in state.cache_history]
    rate_now = state.cache_hit_rate()
    return {
        "tokens": (f"tokens/step {tokens[-1] if tokens else '–'}", tokens),
        "rate": (rate, []),
        "kv": (f"KV used {used[-1]:.0f}%" if used else "KV used –", used),
        "accept": (f"accepted {accepted[-1]:.0f}%" if accepted else "accepted –",
                   accepted),
        "hit": (f"cache hit {100 * rate_now:.0f}%" if rate_now is not None else "cache hit –", hits),
    }


class Metrics(Horizontal):
    frame: reactive[Frame | None] = reactive(None, always_update=True)

    def compose(self) -> ComposeResult:
        for key in ("tokens", "kv", "accept", "hit"):
            with Vertical(classes="metric", id=f"{key}-metric"):
                yield Label("", id=f"{key}-label")
                yield Sparkline([], id=f"{key}-spark")

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        data = series(frame)
        rate = data.pop("rate")[0]
        # columns that apply: "accepted" once drafts were verified, "cache hit" with a prefix cache
        self.query_one("#accept-metric").display = bool(frame.acceptance)
        self.query_one("#hit-metric").display = frame.state.prefix_caching
        self.border_title = f"metrics · {rate} tokens/s" if rate else "metrics"   # the latest step's speed
        for key, (label, values) in data.items():
            self.query_one(f"#{key}-label", Label).update(label, layout=False)   # fixed size: repaint only
            self.query_one(f"#{key}-spark", Sparkline).data = values[-200:]
