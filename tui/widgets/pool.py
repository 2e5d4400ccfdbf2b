"""The KV block pool panel: one cell per physical block, coloured by who holds it.

A cell is free (grey), held by one request (that request's colour), shared
by several requests (white; their block tables all point at it), or cached
(slate): only the radix prefix cache holds it, so a prefix hit can reuse it
or eviction can free it. Blocks allocated, freed, copied or shared this step
are underlined. When swapping is on, a strip under the grid shows the CPU
swap pool, each block in the colour of the swapped-out request it holds.
Across processes a bar shows the ranks of tensor parallelism (whose pool the
title speaks for; `k` switches) and the KV handoffs of disaggregation
(`ranks.py`).
Click a cell, or focus the grid and use the arrow keys, to see the block's
ref count, its owners, the cache node holding it and which token positions
it holds for each request.

Everything is drawn from a `ViewState`; `grid_layout` and `grid_line` (and, in
`block_info.py`, `describe_block`) are plain functions so tests and benchmarks
can call them without an app.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

from nanoserve.trace import ViewState
from nanoserve_tui.palette import CACHED, CURSOR, FREE, HELD, SHARED, TOUCHED, request_colours
from nanoserve_tui.widgets.block_info import cpu_strip, describe_block, legend
from nanoserve_tui.widgets.ranks import rank_title, ranks_text

# What the block details show before a block is selected (two lines): how to select one, and what "x6" means;
# the second for panels under 70 columns.
HINT = Text.assemble(("click a block, or tab + arrows: its ref count, owners, tokens\n", "dim"),
                     ("x6", "bold"), (" on a white cell: 6 holders, the tables sharing it (+1 if cached)", "dim"))
SHORT_HINT = Text.assemble(("click a block (or tab + arrows) for details\n", "dim"),
                           ("x6", "bold"), (": 6 holders (the tables, +1 if cached)", "dim"))
NUMBERED_MAX = 1000   # up to this many blocks a cell shows its id; above, one character per block


@dataclass(frozen=True, slots=True)
class GridLayout:
    """Where each block's cell goes. Cells get more detail the more room there is:

    lines=3: id / owner / fill ("3/4")    lines=2: id / fill
    lines=1: id only                      lines=0: one character, no text (huge pools)
    """

    num_blocks: int
    lines: int
    inner: int            # text width inside a cell
    cols: int
    pad: bool = True      # a space each side of the text and a gap after the cell

    @property
    def cell(self) -> int:
        """Columns per cell, gap included."""
        if self.lines == 0:
            return 1
        return self.inner + 3 if self.pad else self.inner + 1

    @property
    def row_height(self) -> int:
        return self.lines + 1 if self.lines > 1 else 1   # multi-line rows have a blank line between them

    @property
    def rows(self) -> int:
        return -(-self.num_blocks // self.cols)

    @property
    def height(self) -> int:
        return self.rows * self.row_height - (1 if self.lines > 1 else 0)

    def block_at(self, x: int, y: int) -> int | None:
        col, row = x // self.cell, y // self.row_height
        if col >= self.cols or (self.lines > 1 and y % self.row_height == self.lines):
            return None
        block = row * self.cols + col
        return block if block < self.num_blocks else None


def grid_layout(num_blocks: int, block_size: int, width: int, height: int) -> GridLayout:
    """The most detailed layout whose grid fits `height` lines in `width` columns."""
    digits, fill = len(str(num_blocks - 1)), len(f"{block_size}/{block_size}")
    for lines, inner, pad in ((3, max(digits, fill, 6), True), (2, max(digits, fill), True),
                              (1, digits, True), (1, digits, False)):
        if lines > 1 and num_blocks > NUMBERED_MAX:
            continue
        probe = GridLayout(num_blocks, lines, inner, 1, pad)
        layout = GridLayout(num_blocks, lines, inner, max(1, (width + pad) // probe.cell), pad)
        if layout.height <= height:
            return layout
    if num_blocks <= NUMBERED_MAX:
        return layout                                   # ids still shown; the grid scrolls
    return GridLayout(num_blocks, 0, 1, max(1, width))  # huge pools: one character per block


@lru_cache(maxsize=256)
def _style(background: str, touched: bool, selected: bool) -> Style:
    """Cell styles are few; parse each once (a 4096-block grid asks 4096 times per frame)."""
    fg = "#b0b0b0" if background == FREE else "#ffffff" if background == CACHED else "#000000"
    style = Style.parse(f"{fg} on {background}")
    if touched:
        style += Style.parse(TOUCHED)
    if selected:
        style += Style.parse(CURSOR)
    return style


KIND_COLOUR = {"free": FREE, "shared": SHARED, "cached": CACHED, "held": HELD}


def block_colour(kind: str, holders: list[str] | None, colours: dict[str, str]) -> str:
    """A cell's colour from its kind (`ViewState.block_kinds`): a request's own, or one of the special ones."""
    return colours[holders[0]] if kind == "owned" else KIND_COLOUR[kind]


def _cell_lines(state: ViewState, b: int, owners: dict[int, list[str]], kind: str, lines: int) -> list[str]:
    """The text lines of one cell: id, then (3 lines) the owner, then how full it is."""
    ref, bs = state.ref_counts[b], state.block_size
    holders = owners.get(b, [])
    if kind == "free":
        owner, fill = "", ""
    elif kind == "shared":
        owner, fill = f"x{ref}", ""
    elif kind == "cached":
        owner, fill = "cache", ""
    elif holders:
        req = state.sequences[holders[0]]
        g, i = req.locate(b)                          # (KV cache groups: g > 0 is a windowed/other group's)
        owner, fill = holders[0] + (f"/g{g}" if g else ""), f"{max(0, min(bs, req.num_computed_tokens - i * bs))}/{bs}"
    else:
        owner, fill = "held", ""
    if b in state.left_window and kind in ("free", "cached"):   # a window slid past it this step
        owner, fill = "←window", fill
    return [str(b), owner, fill] if lines == 3 else [str(b), fill]


_PLAIN = Style(underline=False, bold=False)   # touched cells underline their id line only
_GAP = Segment(" ")


def grid_line(state: ViewState, layout: GridLayout, y: int, owners: dict[int, list[str]],
              colours: dict[str, str], selected: int | None = None, kinds: list[str] | None = None) -> Strip:
    """Text line `y` of the grid (a grid row is `layout.row_height` lines); `kinds`: `state.block_kinds()`,
    computed once per frame by the caller (or here when not given)."""
    kinds = state.block_kinds(owners) if kinds is None else kinds
    row, line = divmod(y, layout.row_height)
    start = row * layout.cols
    blocks = range(start, min(state.num_blocks, start + layout.cols))
    if line >= max(1, layout.lines) or not blocks:
        return Strip([])                                  # the blank line between multi-line rows
    segments = []
    inner, touched = layout.inner, state.touched_blocks
    for b in blocks:
        style = _style(block_colour(kinds[b], owners.get(b), colours), b in touched, b == selected)
        if layout.lines == 0:
            segments.append(Segment("•" if b in touched else " ", style))
        elif layout.lines == 1 and not layout.pad:
            segments.append(Segment(f"{b:>{inner + 1}}", style))
        else:
            label = str(b) if line == 0 else _cell_lines(state, b, owners, kinds[b], layout.lines)[line][:inner]
            segments.append(Segment(f" {label:^{inner}} ", style if line == 0 else style + _PLAIN))
            segments.append(_GAP)
    return Strip(segments)


class PoolGrid(ScrollView, can_focus=True):
    """The grid of blocks (Line API: only rows on screen are drawn).

    Arrow keys move the selection when focused; a click selects.
    """

    BINDINGS = [
        Binding("left", "move(-1)", "previous block", show=False),
        Binding("right", "move(1)", "next block", show=False),
        Binding("up", "move_row(-1)", "block above", show=False),
        Binding("down", "move_row(1)", "block below", show=False),
    ]

    state: reactive[ViewState | None] = reactive(None, always_update=True)
    selected: reactive[int | None] = reactive(None)

    class BlockSelected(Message):
        """The user selected a block."""

        def __init__(self, block_id: int | None) -> None:
            super().__init__()
            self.block_id = block_id

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layout_: GridLayout | None = None
        self._owners: dict[int, list[str]] = {}
        self._colours: dict[str, str] = {}
        self._kinds: list[str] = []

    def watch_state(self, state: ViewState | None) -> None:
        if state is not None:   # once per step, not once per drawn row
            self._owners, self._colours = state.block_owners(), request_colours(state)
            self._kinds = state.block_kinds(self._owners)
        self._relayout()

    def watch_selected(self, block_id: int | None) -> None:
        self.post_message(self.BlockSelected(block_id))
        self.refresh()
        if block_id is not None and self.layout_ is not None:
            y = block_id // self.layout_.cols * self.layout_.row_height
            self.scroll_to_region(Region(0, y, 1, max(1, self.layout_.lines)), animate=False, immediate=True)

    def on_resize(self) -> None:
        self._relayout()

    def _relayout(self) -> None:
        """Pick the most detailed layout that fits, and size the scrollable area to it."""
        if self.state is None:
            return
        width, height = self.scrollable_content_region.size
        self.layout_ = grid_layout(self.state.num_blocks, self.state.block_size, max(1, width), max(1, height))
        self.virtual_size = Size(self.layout_.cols * self.layout_.cell, self.layout_.height)
        self.refresh()

    def render_line(self, y: int) -> Strip:
        style = self.rich_style
        if self.state is None or self.layout_ is None:
            text = "waiting for the engine …" if y == 0 else ""
            return Strip([Segment(text, style + Style(dim=True))]).extend_cell_length(self.size.width, style)
        index = y + self.scroll_offset.y
        if index >= self.layout_.height:
            return Strip.blank(self.size.width, style)
        strip = grid_line(self.state, self.layout_, index, self._owners, self._colours, self.selected, self._kinds)
        return strip.crop_extend(0, self.size.width, style).apply_style(style)

    @property
    def text(self) -> str:
        """The whole grid as plain text (what tests compare)."""
        if self.state is None or self.layout_ is None:
            return ""
        return "\n".join(grid_line(self.state, self.layout_, y, self._owners, self._colours,
                                   kinds=self._kinds).text.rstrip() for y in range(self.layout_.height))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or self.layout_ is None:
            return
        block_id = self.layout_.block_at(offset.x + self.scroll_offset.x, offset.y + self.scroll_offset.y)
        if block_id is not None:
            self.selected = block_id

    def action_move(self, delta: int) -> None:
        if self.state is not None:
            start = -1 if delta > 0 else self.state.num_blocks
            current = self.selected if self.selected is not None else start
            self.selected = max(0, min(self.state.num_blocks - 1, current + delta))

    def action_move_row(self, delta: int) -> None:
        if self.layout_ is not None:
            self.action_move(delta * self.layout_.cols)


class PoolPanel(Vertical):
    """Grid + details of the selected block; the colour key is the panel's bottom border (when it fits).

    Everything under the grid has a fixed height, so selecting a block never changes the grid's layout."""

    state: reactive[ViewState | None] = reactive(None, always_update=True)

    selected_rank = reactive(0)   # tensor parallelism: whose pool the panel speaks for (`k` switches)

    def compose(self) -> ComposeResult:
        yield PoolGrid(id="pool-grid")
        yield Static(id="cpu-pool")
        yield Static(id="ranks")
        yield Static(HINT, id="block-info")

    def watch_state(self, state: ViewState | None) -> None:
        grid = self.query_one(PoolGrid)
        grid.state = state
        if state is not None:
            self._show_legend()
            self._show_cpu()
            self._show_ranks()
        self._show_block(grid.selected)

    def watch_selected_rank(self, rank: int) -> None:
        self._show_ranks()
        self._show_block(self.query_one(PoolGrid).selected)

    def _show_ranks(self) -> None:
        """The ranks and KV handoffs bar, and whose pool the title speaks for; hidden for one process."""
        if self.state is None:
            return
        bar = self.query_one("#ranks", Static)
        bar.display = bool(self.state.ranks or self.state.transfers)
        if bar.display:
            bar.update(ranks_text(self.state, self.selected_rank))
        rank = min(self.selected_rank, len(self.state.ranks) - 1)
        self.border_title = rank_title(self.state, rank) if self.state.ranks else "KV block pool"

    def on_resize(self) -> None:
        self._show_legend()
        self._show_cpu()
        if self.query_one(PoolGrid).selected is None:
            self.query_one("#block-info", Static).update(HINT if self.size.width >= 70 else SHORT_HINT)

    def _show_legend(self) -> None:
        """The colour key in the bottom border: the widest form that fits (shorter words on a narrow screen)."""
        if self.state is None:
            return
        key = legend(self.state, self.size.width - 4)
        fits = key.cell_len + 4 <= self.size.width
        if (self.state.prefix_caching, key.plain, fits) != getattr(self, "_legend_for", None):   # engine, width
            self._legend_for = (self.state.prefix_caching, key.plain, fits)
            self.border_subtitle = key if fits else None

    def _show_cpu(self) -> None:
        """The CPU swap strip, as wide as the panel; hidden when the engine does not swap."""
        if self.state is None:
            return
        cpu = self.query_one("#cpu-pool", Static)
        cpu.display = self.state.num_cpu_blocks > 0
        if cpu.display:
            colours = request_colours(self.state)
            cpu.update(cpu_strip(self.state, colours, max(20, self.scrollable_content_region.width)))

    @on(PoolGrid.BlockSelected)
    def _selected(self, message: PoolGrid.BlockSelected) -> None:
        self._show_block(message.block_id)

    def _show_block(self, block_id: int | None) -> None:
        if self.state is None or block_id is None or block_id >= self.state.num_blocks:
            return
        rank = self.state.ranks[min(self.selected_rank, len(self.state.ranks) - 1)] if self.state.ranks else None
        self.query_one("#block-info", Static).update(describe_block(self.state, block_id, rank))
