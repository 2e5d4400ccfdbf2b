"""`LinesView`: a scrolling panel that draws only the lines on screen (Textual's Line API).

Panels that grow with the engine (a 4096-block pool, 256 block tables, 256
requests, 500 events a step) tell the view how many lines they have and how
to build line `i`; `render_line` builds just the rows in view, once per
frame. Going through `Static`, every line would be wrapped and styled on
each step, visible or not, which costs ~100x more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rich.segment import Segment
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

Cells = list[Segment]   # one line, as styled pieces


def wrap(pieces: Iterable[tuple[Cells, int]], width: int, first: Cells, indent: int) -> list[Strip]:
    """Lay `pieces` (segments, their width in cells) out after `first`, starting a new,
    indented line when one would not fit. A piece (e.g. one block-table entry) is never split.
    """
    lines: list[Strip] = []
    line, used = list(first), sum(s.cell_length for s in first)
    for piece, size in pieces:
        if used + size > width and used > indent:
            lines.append(Strip(line, used))
            line, used = [Segment(" " * indent)], indent
            if piece and piece[0].text.startswith(" "):   # a separating space is not needed at a line start
                head = piece[0]
                piece = [Segment(head.text[1:], head.style), *piece[1:]]
                size -= 1
        line.extend(piece)
        used += size
    lines.append(Strip(line, used))
    return lines


def breaks(sizes: Iterable[int], width: int, first: int, indent: int) -> list[int]:
    """Where `wrap` would start each line, from the pieces' widths alone: piece indices."""
    starts, used = [0], first
    for i, size in enumerate(sizes):
        if used + size > width and used > indent:
            starts.append(i)
            used = indent
        used += size                    # (block-table entries start with spaces that are kept)
    return starts


class LinesView(ScrollView):
    """Shows `count` lines, building line `i` with `line(i)` only when it scrolls into view."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._count = 0
        self._line: Callable[[int], Strip] = lambda i: Strip([])
        self._cache: dict[int, Strip] = {}      # lines built for the current content

    def show(self, count: int, width: int, line: Callable[[int], Strip]) -> None:
        """New content: `count` lines, the widest `width` cells, built by `line`."""
        self._count, self._line, self._cache = count, line, {}
        self.virtual_size = Size(width, count)
        self.refresh()

    def show_lines(self, lines: list[Strip]) -> None:
        self.show(len(lines), max((s.cell_length for s in lines), default=0), lines.__getitem__)

    def get_line(self, index: int) -> Strip:
        strip = self._cache.get(index)
        if strip is None:
            strip = self._cache[index] = self._line(index)
        return strip

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = y + scroll_y
        style = self.rich_style
        if index >= self._count:
            return Strip.blank(self.size.width, style)
        return self.get_line(index).crop_extend(scroll_x, scroll_x + self.size.width, style).apply_style(style)

    @property
    def text(self) -> str:
        """Every line as plain text (what tests compare)."""
        return "\n".join(self.get_line(i).text.rstrip() for i in range(self._count))
