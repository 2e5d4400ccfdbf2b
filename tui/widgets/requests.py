"""Request queues: running, waiting, swapped out and finished, with progress and streaming text.

Each request takes two lines: its colour and id, status, a bar of
`num_output_tokens/max_tokens`, its prompt tokens and its tokens with K/V in
the cache ("KV");
then the newest generated text that fits. A request with structured output
has a third: its grammar's mask at the last token and how many tokens the
grammar forced ("grammar json: 3 of 49,152 allowed · forced 5 of 12"). A request can be selected (click
it, or ↑/↓ when the list has focus) for the abort and fork controls.

A Line API view (see `lines.py`): with 256 requests each changing every
step, rebuilding option widgets would cost more than the whole step.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region
from textual.reactive import reactive
from textual.strip import Strip

from nanoserve.trace import ViewState
from nanoserve_tui.palette import STATUS_STYLE, printable, request_colours
from nanoserve_tui.widgets.lines import LinesView

BAR = 10   # characters of the progress bar
DIM, BOLD, ITALIC = Style(dim=True), Style(bold=True), Style(italic=True)
EMPTY_BAR = Style.parse("#444444")
SELECTED = Style.parse("on #2c4a6e")


def request_lines(state: ViewState, rid: str, colour: str, width: int) -> tuple[Strip, ...]:
    """Two lines: id, status, progress; then the newest generated text that fits (and a third with
    structured output: the grammar's mask)."""
    req = state.sequences[rid]
    total = str(req.max_tokens) if req.max_tokens else "?"
    bar = BAR if width >= 60 else BAR // 2                       # narrow panels: a shorter bar
    filled = min(bar, round(bar * req.num_output_tokens / req.max_tokens)) if req.max_tokens else 0
    head = [Segment(f" {rid} ", Style.parse(f"#000000 on {colour}")), Segment(" "),
            Segment(f"{req.status.removeprefix('finished_'):<8} ", Style.parse(STATUS_STYLE.get(req.status, "none")))]
    bars = [Segment("━" * filled, Style.parse(colour)), Segment("━" * (bar - filled), EMPTY_BAR), Segment(" ")]
    cpu = " on CPU" if req.cpu_block_table else ""
    # the roomiest line that fits: with the bar, without it, then "p" for "prompt"
    for middle, prompt in ((bars, "prompt "), ([], "prompt "), ([], "p")):
        tail = [Segment(f"{req.num_output_tokens}/{total}"),
                Segment(f" · {prompt}{req.num_prompt_tokens} · KV {req.num_computed_tokens}{cpu}", DIM)]
        first = Strip(head + middle + tail)
        if first.cell_length <= width:
            break
    first = first.crop(0, width)
    room = max(8, width - 3)
    out = printable(req.output_text)
    out = out if len(out) <= room else "…" + out[-(room - 1):]   # the newest text stays visible
    second = Strip([Segment("   "), Segment(out, ITALIC) if out else Segment("(no output yet)", DIM)]).crop(0, width)
    if req.grammar is None:
        return first, second
    return first, second, Strip([Segment("   "), Segment(req.grammar.summary(), DIM)]).crop(0, width)


def num_lines(state: ViewState, rid: str) -> int:
    """Lines a request takes: 3 with structured output, else 2."""
    return 2 if state.sequences[rid].grammar is None else 3


class QueueLayout:
    """Which request each line belongs to; a request's two lines are built when they scroll into view."""

    def __init__(self, state: ViewState, width: int, selected: str | None) -> None:
        self.state, self.width, self.selected = state, width, selected
        self.colours = request_colours(state)
        self.owners: list[str | None] = []          # per line: request id, or None for a header
        self.headers: dict[int, Strip] = {}
        queues = [("running", state.running), ("waiting", state.waiting)]
        if state.num_cpu_blocks or state.swapped:           # only engines that swap have this queue
            queues.append(("swapped", state.swapped))
        for name, ids in queues + [("finished", state.finished)]:
            self.headers[len(self.owners)] = Strip([Segment(f"{name.upper()} ({len(ids)})", BOLD)])
            self.owners.append(None)
            for rid in ids:
                self.owners += [rid] * num_lines(state, rid)

    def line(self, index: int) -> Strip:
        rid = self.owners[index]
        if rid is None:
            return self.headers[index]
        offset = 0                                    # which of the request's lines this is
        while index - offset > 0 and self.owners[index - offset - 1] == rid:
            offset += 1
        strip = request_lines(self.state, rid, self.colours[rid], self.width)[offset]
        if rid == self.selected:
            strip = strip.extend_cell_length(self.width).apply_style(SELECTED)
        return strip


class RequestList(LinesView, can_focus=True):
    """The queues in one list; `selected` is the request abort and fork act on."""

    BINDINGS = [
        Binding("up", "move(-1)", "previous request", show=False),
        Binding("down", "move(1)", "next request", show=False),
    ]

    state: reactive[ViewState | None] = reactive(None, always_update=True)
    selected: reactive[str | None] = reactive(None)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._owners: list[str | None] = []

    @property
    def selected_request(self) -> str | None:
        return self.selected

    def watch_state(self, state: ViewState | None) -> None:
        self._rebuild()

    def watch_selected(self, rid: str | None) -> None:
        self._rebuild()
        if rid in self._owners:
            self.scroll_to_region(Region(0, self._owners.index(rid), 1, self._owners.count(rid)), animate=False,
                                  immediate=True)

    def on_resize(self) -> None:
        self._rebuild()

    def _rebuild(self) -> None:
        if self.state is None:
            return
        layout = QueueLayout(self.state, max(20, self.scrollable_content_region.width), self.selected)
        self._owners = layout.owners
        self.show(len(layout.owners), layout.width, layout.line)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is not None:
            index = offset.y + self.scroll_offset.y
            if 0 <= index < len(self._owners) and self._owners[index] is not None:
                self.selected = self._owners[index]

    def action_move(self, delta: int) -> None:
        order = list(dict.fromkeys(rid for rid in self._owners if rid is not None))
        if not order:
            return
        if self.selected not in order:
            self.selected = order[0 if delta > 0 else -1]
        else:
            self.selected = order[max(0, min(len(order) - 1, order.index(self.selected) + delta))]
