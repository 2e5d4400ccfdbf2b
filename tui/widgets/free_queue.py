"""The free queue: free blocks in LRU order, head (the next one handed out) first.

Freed blocks go to the tail, so a block that was just released is reused
last. Blocks released this step are highlighted.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.reactive import reactive
from textual.strip import Strip

from nanoserve.trace import ViewState
from nanoserve_tui.widgets.lines import LinesView, wrap

SHOWN = 1000   # ids drawn at most; past that the count says it
FRESH, OLD, DIM, BOLD = Style.parse("bold #e5c07b"), Style.parse("#9a9a9a"), Style(dim=True), Style(bold=True)


def free_queue_lines(state: ViewState, width: int) -> list[Strip]:
    queue, touched = state.free_queue, state.touched_blocks
    head = Strip([Segment(f"{len(queue)}/{state.num_blocks} free", BOLD)]
                 + ([Segment(", LRU order, head first", DIM)] if width >= 34 else
                    [Segment(", head first", DIM)] if width >= 24 else []))   # narrow: the count only
    pieces = []
    for n, block_id in enumerate(queue[:SHOWN]):
        label = f"{block_id}" if n == 0 else f" {block_id}"
        pieces.append(([Segment(label, FRESH if block_id in touched else OLD)], len(label)))
    if len(queue) > SHOWN:
        pieces.append(([Segment(f" … +{len(queue) - SHOWN} more", DIM)], 12))
    return [head] + (wrap(pieces, width, [], 0) if pieces else [])


class FreeQueue(LinesView):
    state: reactive[ViewState | None] = reactive(None, always_update=True)

    def watch_state(self, state: ViewState | None) -> None:
        if state is not None:
            self.show_lines(free_queue_lines(state, max(10, self.scrollable_content_region.width)))

    def on_resize(self) -> None:
        self.watch_state(self.state)
