"""The look shared by nanoserve's Graphviz pictures: colours, fonts, and the DOT building blocks.

`graphviz.py` (block tables, the pool) and `radix_dot.py` (the prefix tree)
both draw with these, so a request has the same colour in every picture and
a cached block the same fill. Both import this module; neither imports the
other's helpers.
"""

from __future__ import annotations

from graphviz import Digraph

from nanoserve.view import ViewState

# (light fill, dark line) per request, in arrival order. No gold or red here:
# gold marks shared blocks and red marks blocks touched this step.
PALETTE = [("#c6dbef", "#2171b5"), ("#c7e9c0", "#238b45"), ("#dadaeb", "#6a51a3"),
           ("#c7eae5", "#01665e"), ("#fcc5e0", "#ae017e"), ("#e6d5c3", "#8c510a"),
           ("#d9d9d9", "#525252"), ("#c2e1ff", "#08306b")]
SHARED_FILL, SHARED_LINE = "#ffd92f", "#b8860b"
FREE_FILL, TOUCHED_LINE = "#ffffff", "#d62728"
CACHED_FILL = "#b7b7a4"      # only the prefix cache holds it: reusable by a hit, or evicted for room
HELD_FILL = "#eeeeee"        # held by no request we know
MAX_POOL_CELLS = 512     # a real pool has thousands of blocks; draw the first ones
MAX_QUEUE_IDS = 40       # free-queue ids shown before "…"
FONT = "Helvetica"


def colours_of(state: ViewState) -> dict[str, tuple[str, str]]:
    """Request id -> (fill, line). Arrival order, so colours stay put from step to step."""
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(state.sequences)}


def graph(name: str, title: str, rankdir: str) -> Digraph:
    """An empty picture with the house style: a title on top, plaintext nodes holding HTML tables."""
    g = Digraph(name)
    g.attr(rankdir=rankdir, label=title, labelloc="t", fontname=FONT, fontsize="16", nodesep="0.3")
    g.attr("node", shape="plaintext", fontname=FONT, fontsize="11")
    g.attr("edge", arrowsize="0.6", penwidth="1.4")
    return g


def html_table(rows: list[str], spacing: int = 0) -> str:
    """A Graphviz HTML-like label: the given <TR> rows in a table of 1-pixel cells."""
    return (f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="{spacing}" CELLPADDING="4">'
            + "".join(rows) + "</TABLE>>")
