"""Two runs side by side, in lockstep: `nanoserve compare ... --tui`.

    nanoserve compare --scenario memory-pressure --set preemption_mode=swap --tui
    nanoserve compare --trace a.jsonl --trace b.jsonl --tui

Each side is a replayed trace (`ReplaySource`: the fold of steps 0..N, cached),
drawn by the live TUI's own pool grid and block tables. Both sides move
together, one step per key. Below them the difference panel shows, at the
current step, the numbers `nanoserve compare` prints for the whole run
(blocks, tokens computed, prefix hits, preemptions, swaps, CoW copies, from
`nanoserve.whatif.metrics`), and marks the first step where the runs diverge.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static

from nanoserve.whatif.compare import Comparison
from nanoserve.whatif.metrics import RunMetrics, StepRow
from nanoserve_tui.source import ReplaySource
from nanoserve_tui.widgets.pool import PoolPanel
from nanoserve_tui.widgets.tables import BlockTables

# The rows of the difference panel: (label, what to read from the StepRow at the current step).
ROWS = [
    ("blocks in use", lambda r: r.in_use), ("  cached (evictable)", lambda r: r.cached),
    ("  swapped (CPU blocks)", lambda r: r.swapped), ("prefix hit tokens", lambda r: r.prefix_hit_tokens),
    ("preemptions", lambda r: r.preemptions), ("swaps", lambda r: r.swaps), ("CoW copies", lambda r: r.cow_copies),
]


def row_at(m: RunMetrics, step: int) -> StepRow | None:
    """The last StepRow at or before `step` (None before the first step)."""
    rows = [r for r in m.steps if r.step <= step]
    return rows[-1] if rows else None


def computed_until(m: RunMetrics, step: int) -> int:
    return sum(r.prefill_tokens + r.decode_tokens for r in m.steps if r.step <= step)


def request_table(c: Comparison, step: int) -> Table:
    """Per request: the step of its first token and of its finish, once reached ("-": not yet)."""
    table = Table(box=None, padding=(0, 2, 0, 0), expand=False)
    for col in ("request", f"{c.labels[0]} first", f"{c.labels[1]} first", f"{c.labels[0]} finish",
                f"{c.labels[1]} finish"):
        table.add_column(col, justify="left" if col == "request" else "right")

    def seen(value):
        return value if value is not None and value <= step else None

    for rid, (a_first, a_end), (b_first, b_end) in c.request_rows():
        cells = [seen(a_first), seen(b_first), seen(a_end), seen(b_end)]
        styles = ["", "bold #e5c07b" if cells[1] != cells[0] else "", "", "bold #e5c07b" if cells[3] != cells[2] else ""]
        table.add_row(rid, *(Text("-" if v is None else str(v), style=st) for v, st in zip(cells, styles)))
    return table


def difference_panel(c: Comparison, step: int) -> Table:
    """Totals at `step` (left) and per-request steps (right), side by side."""
    grid = Table.grid(padding=(0, 6))
    grid.add_row(difference_table(c, step), request_table(c, step))
    return grid


def difference_table(c: Comparison, step: int) -> Table:
    """The difference panel at `step`: A, B and B - A for each row, bold where they differ."""
    table = Table(box=None, padding=(0, 2, 0, 0), expand=False)
    for col, justify in (("", "left"), (c.labels[0], "right"), (c.labels[1], "right"), ("B - A", "right")):
        table.add_column(col, justify=justify)
    a, b = row_at(c.a, step), row_at(c.b, step)
    values = [(label, read(a) if a else 0, read(b) if b else 0) for label, read in ROWS]
    values.insert(3, ("tokens computed so far", computed_until(c.a, step), computed_until(c.b, step)))
    for label, x, y in values:
        style = "bold #e5c07b" if x != y else ""
        table.add_row(label, str(x), str(y), Text(f"{y - x:+d}" if y != x else "0", style=style))
    return table


class CompareApp(App[None]):
    CSS_PATH = "compare.tcss"
    TITLE = "nanoserve compare"
    BINDINGS = [
        Binding("space,n,right", "step(1)", "step"),
        Binding("b,left", "step(-1)", "back"),
        Binding("d", "divergence", "first divergence"),
        Binding("home", "goto(0)", "start"),
        Binding("end", "goto(-1)", "end"),
        Binding("q", "quit", "quit"),
    ]

    step: reactive[int] = reactive(0)

    def __init__(self, comparison: Comparison, events_a, events_b) -> None:
        super().__init__()
        self.comparison = comparison
        self.sides = (ReplaySource(events_a, comparison.labels[0]), ReplaySource(events_b, comparison.labels[1]))
        self.last = max(side.last for side in self.sides)

    def compose(self) -> ComposeResult:
        yield Static(id="headline")
        with Horizontal(id="sides"):
            for i, side in enumerate(self.sides):
                with Vertical(classes="side"):
                    yield PoolPanel(id=f"pool-{i}", classes="panel")
                    yield BlockTables(id=f"tables-{i}", classes="panel")
        yield Static(id="difference", classes="panel")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        for i, side in enumerate(self.sides):
            self.query_one(f"#pool-{i}").border_title = f"{side.description}: KV block pool"
            self.query_one(f"#tables-{i}").border_title = f"{side.description}: block tables"
        self.query_one("#difference").border_title = "difference at this step"
        self.watch_step(self.step)

    def watch_step(self, step: int) -> None:
        for i, side in enumerate(self.sides):
            state = side.frame(min(step, side.last)).state
            self.query_one(f"#pool-{i}", PoolPanel).state = state
            self.query_one(f"#tables-{i}", BlockTables).state = state
        self.query_one("#difference", Static).update(difference_panel(self.comparison, step))
        self.query_one("#headline", Static).update(self.headline(step))

    def headline(self, step: int) -> Text:
        first = self.comparison.first_divergence
        if first is None:
            mark = ("the runs never diverge", "#98c379")
        elif step < first:
            mark = (f"the same run so far; they diverge at step {first} (d)", "#98c379")
        else:
            mark = (f"diverged at step {first}" + (" ◆ this step" if step == first else ""), "bold #e06c75")
        return Text.assemble((" nanoserve compare ", "bold"), f"  {self.comparison.headline().split(':')[0]}  ",
                             (f"step {step}/{self.last}", "bold"), "  ", mark)

    def get_system_commands(self, screen: Screen):
        """The command palette (Ctrl+P): Textual's own commands (themes, keys, screenshot), then these."""
        yield from super().get_system_commands(screen)
        for action, title, help in (("step(1)", "Step", "both runs one step forward (space)"),
                                    ("step(-1)", "Step back", "both runs one step back (b)"),
                                    ("divergence", "First divergence", "jump to the first step where they differ (d)"),
                                    ("goto(0)", "Start", "step 0 (home)"), ("goto(-1)", "End", "the last step (end)")):
            yield SystemCommand(title, help, lambda action=action: self.run_action(action))

    def action_step(self, delta: int) -> None:
        self.step = max(0, min(self.last, self.step + delta))

    def action_goto(self, step: int) -> None:
        self.step = self.last if step < 0 else step

    def action_divergence(self) -> None:
        first = self.comparison.first_divergence
        if first is None:
            self.notify("the runs never diverge", severity="warning")
        else:
            self.step = min(first, self.last)


def run_compare_app(comparison: Comparison, events_a, events_b) -> int:
    CompareApp(comparison, events_a, events_b).run()
    return 0
