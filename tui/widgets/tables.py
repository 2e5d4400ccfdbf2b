"""Block tables: for each request, logical block -> physical block.

`r1  0→3  1→7  2→9(2/4)` (physical ids on the request's colour) says r1's
tokens 0-3 live in block 3, tokens 4-7 in block 7, and block 9 holds 2 of its
4 slots so far: the partly filled last block, where the next tokens go.
Running requests come first, then waiting ones (which hold no blocks), then
swapped-out ones (their KV sits in CPU blocks: `r2  on CPU c0 c1 c2`).
Blocks that more than one request's table holds are marked `*` (shared).
A model with KV cache groups (kv_groups.py) has one table per group: group 0's
on the request's line, each other group's under it (`  g1 W8  0→·  1→·  2→31`),
`·` where a block left the group's sliding window and went back to the pool.
Drawn from a `ViewState` only.
"""

from __future__ import annotations

from collections import Counter

from rich.segment import Segment
from rich.style import Style
from textual.reactive import reactive
from textual.strip import Strip

from nanoserve.trace import ViewState
from nanoserve_tui.palette import request_colours
from nanoserve_tui.widgets.lines import LinesView, breaks

DIM, BOLD = Style(dim=True), Style(bold=True)


def shared_blocks(state: ViewState, live: list[str]) -> set[int]:
    """Blocks in more than one live request's table. Only blocks with ref count > 1 can be, so
    most steps of a big run without sharing cost one pass over the ref counts."""
    multi = {b for b, ref in enumerate(state.ref_counts) if ref > 1}
    if not multi:
        return set()
    counts = Counter(b for rid in live for t in [state.sequences[rid].block_table, *state.sequences[rid].group_tables]
                     for b in t if b in multi)
    return {b for b, n in counts.items() if n > 1}


class TablesLayout:
    """Which request and which of its entries go on each line, from widths alone.

    Only the lines on screen are then built (`line(i)`): 256 requests x 14
    blocks would otherwise be ~10k segments per step.
    """

    def __init__(self, state: ViewState, width: int) -> None:
        self.state, self.colours = state, request_colours(state)
        live = state.running + state.waiting + state.swapped
        self.shared = shared_blocks(state, live)
        self.name_width = max((len(rid) for rid in live), default=0) + 2
        self.name_width = max(self.name_width, 8 if state.kv_groups else 0)   # room for "g1 W512"
        # (request id, KV cache group, first entry, end entry) per line
        self.rows: list[tuple[str, int, int, int]] = []
        bs = state.block_size
        for rid in live:
            req = state.sequences[rid]
            computed = req.num_computed_tokens
            for g, table in enumerate([req.block_table, *req.group_tables]):
                if g and not table:
                    continue
                sizes = [3 + len(str(i)) + len(str(b)) + (b in self.shared) + (
                    0 if computed - i * bs >= bs else len(f"({max(0, computed - i * bs)}/{bs})"))
                    for i, b in enumerate(table)]
                starts = breaks(sizes, width, self.name_width, self.name_width)
                ends = starts[1:] + [len(table)]
                self.rows.extend((rid, g, a, b) for a, b in zip(starts, ends))
        self.width = width

    def line(self, index: int) -> Strip:
        if not self.rows:
            return Strip([Segment("no request holds blocks", DIM)])
        rid, g, start, end = self.rows[index]
        req, bs = self.state.sequences[rid], self.state.block_size
        chip = Style.parse(f"bold #000000 on {self.colours[rid]}")
        table = req.group_tables[g - 1] if g else req.block_table
        if start == 0 and g:                     # another KV cache group's table: its number and window
            window = self.state.kv_groups[g][0] if g < len(self.state.kv_groups) else 0
            segments = [Segment(f"  g{g}{f' W{window}' if window else ''}".ljust(self.name_width), DIM)]
        elif start == 0:
            segments = [Segment(f" {rid} ".ljust(self.name_width), chip)]
        else:
            segments = [Segment(" " * self.name_width)]
        if not g and req.cpu_block_table:
            segments.append(Segment("  on CPU " + " ".join(f"c{b}" for b in req.cpu_block_table), DIM))
        elif not g and not req.block_table:
            why = "preempted, waiting" if req.num_output_tokens else "waiting"
            segments.append(Segment(f"  no blocks ({why})", DIM))
        for i in range(start, end):
            filled = max(0, min(bs, req.num_computed_tokens - i * bs))
            block = table[i]
            if block < 0:                        # left the group's window: back in the pool
                segments += [Segment(f"  {i}→·", DIM)]
                continue
            segments += [Segment(f"  {i}→", DIM), Segment(str(block), chip)]
            if block in self.shared:
                segments.append(Segment("*", BOLD))
            if filled < bs:
                segments.append(Segment(f"({filled}/{bs})", BOLD))
        return Strip(segments)

    @property
    def count(self) -> int:
        return max(1, len(self.rows))


class BlockTables(LinesView):
    """Every live request's block table, running first."""

    state: reactive[ViewState | None] = reactive(None, always_update=True)

    def watch_state(self, state: ViewState | None) -> None:
        if state is None:
            self.show_lines([Strip([Segment("waiting for the engine …", DIM)])])
            return
        layout = TablesLayout(state, max(20, self.scrollable_content_region.width))
        self.show(layout.count, layout.width, layout.line)

    def on_resize(self) -> None:
        self.watch_state(self.state)
