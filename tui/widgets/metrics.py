"""Metrics over time, as bars on fixed scales, from `ViewState.history`.

* tokens/step: tokens computed in each step (prefill + decode), bars from 0 to
  the most any step of the run computed (the label says that maximum);
* KV used: blocks held by a request's block table, out of the pool, 0 to 100 %;
  with a prefix cache the label also counts the blocks only the cache holds
  ("cached": evictable). The words are /metrics' (nanoserve/kv_usage.py), and
  so are the numbers;
* accepted (speculative decoding, once drafts were verified): the share of
  drafted tokens the target accepted, 0 to 100 %;
* cache hit (with a prefix cache): prompt tokens served from the cache /
  tokens looked up, since the engine started (as /metrics counts it), 0 to 100 %.

Every bar is measured from zero on a scale that does not move with the data,
so 1 % draws as almost nothing and 100 % as a full bar. (Textual's
`Sparkline` stretches its data's min..max over the height, which would draw
1 % as a full bar.) One column per step, newest at the right. The panel's
title has the latest step's speed in tokens per second.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label

from nanoserve.trace import ViewState
from nanoserve_tui.source import Frame

EIGHTHS = " ▁▂▃▄▅▆▇█"   # a cell filled 0/8 .. 8/8 from the bottom


def bar_rows(values: Sequence[float], top: float, width: int, height: int) -> list[str]:
    """Text rows (top row first) drawing the last `width` values as bars from 0 to `top`."""
    shown = list(values)[-width:] if width > 0 else []
    eighths = [round(8 * height * min(1.0, max(0.0, v / top))) if top > 0 else 0 for v in shown]
    rows = []
    for row in reversed(range(height)):          # row 0 is the bottom one
        rows.append("".join(EIGHTHS[max(0, min(8, e - 8 * row))] for e in eighths).ljust(width))
    return rows


class Bars(Widget):
    """Bars of `values` on a fixed scale: a full-height bar is `top` (the area's shade shows where that is)."""

    DEFAULT_CSS = """
    Bars {
        height: 1;
        color: $primary;
        background: $boost;
    }
    """

    values: reactive[tuple[float, ...]] = reactive((), layout=False)
    top: reactive[float] = reactive(100.0, layout=False)

    def render(self) -> Text:
        return Text("\n".join(bar_rows(self.values, self.top, self.size.width, self.size.height)), no_wrap=True)


def rate_text(tokens: int, seconds: float) -> str:
    """Tokens per second, e.g. `1 tok/s`, `334 tok/s`, `1.2k tok/s`."""
    per_s = tokens / seconds
    return f"{per_s / 1000:.1f}k tok/s" if per_s >= 1000 else f"{per_s:.0f} tok/s"


def series(frame: Frame) -> dict[str, tuple[tuple[str, str], list[float], float]]:
    """Metric id -> (labels with the latest value, longest first, values per step, the value of a full bar)."""
    state = frame.state
    tokens = [p + d for _, p, d, _, _ in state.history]
    used = [u for _, u, _ in state.kv_history]
    accepted = [100 * r for r in frame.acceptance]
    hits = [100 * hit / looked_up for _, hit, looked_up in state.cache_history]
    rate_now = state.cache_hit_rate()
    return {
        "tokens": ((f"tokens/step {tokens[-1]} (max {max(tokens)})", f"tok/step {tokens[-1]}") if tokens
                   else ("tokens/step –", "tok/step –"), tokens, max(tokens, default=1)),
        "kv": (kv_labels(state) if used else ("KV used –", "KV –"), [100 * u / state.num_blocks for u in used],
               100.0),
        "accept": ((f"accepted {accepted[-1]:.0f}%", f"accept {accepted[-1]:.0f}%") if accepted
                   else ("accepted –", "accept –"), accepted, 100.0),
        "hit": ((f"cache hit {100 * rate_now:.0f}%", f"hit {100 * rate_now:.0f}%") if rate_now is not None
                else ("cache hit –", "hit –"), hits, 100.0),
    }


def kv_labels(state: ViewState) -> tuple[str, str]:
    """The KV labels, longest first: used (and, with a prefix cache, cached) blocks of the pool, now."""
    usage, total = state.kv_usage(), state.num_blocks
    if not state.prefix_caching:
        return f"KV {usage.used}/{total} blocks used", f"KV {usage.used}/{total}"
    return (f"KV {usage.used} used · {usage.cached} cached /{total}", f"KV {usage.used} used, {usage.cached} cached",
            f"KV used {usage.used}/{total}")


# The metrics panel's subtitle with a prefix cache: what "used", "cached" and "hit" count (kv_usage.py), the
# longest that fits.
WORDS = ("used: in a request's table · cached: only the cache's · hit: since engine start",
         "used: a request's · cached: cache only · hit: since start",
         "used/cached/hit: see ?")


class Metrics(Horizontal):
    frame: reactive[Frame | None] = reactive(None, always_update=True)

    def compose(self) -> ComposeResult:
        for key in ("tokens", "kv", "accept", "hit"):
            with Vertical(classes="metric", id=f"{key}-metric"):
                yield Label("", id=f"{key}-label")
                yield Bars(id=f"{key}-bars")

    def on_resize(self) -> None:
        self.watch_frame(self.frame)         # the labels that fit change with the width

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        # columns that apply: "accepted" once drafts were verified, "cache hit" with a prefix cache
        self.query_one("#accept-metric").display = bool(frame.acceptance)
        self.query_one("#hit-metric").display = frame.state.prefix_caching
        history = frame.state.history
        rate = rate_text(history[-1][1] + history[-1][2], history[-1][4]) if history and history[-1][4] > 0 else ""
        self.border_title = f"metrics · last step {rate}" if rate else "metrics"
        room = self.size.width - 4
        self.border_subtitle = next((w for w in WORDS if len(w) <= room), "") if frame.state.prefix_caching else ""
        for key, (labels, values, top) in series(frame).items():
            label = self.query_one(f"#{key}-label", Label)
            room = label.size.width
            fits = next((text for text in labels if not room or len(text) <= room), labels[-1])
            label.update(fits, layout=False)   # fixed size: repaint
            bars = self.query_one(f"#{key}-bars", Bars)
            bars.values, bars.top = tuple(values[-200:]), top
