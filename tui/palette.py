"""Colours and small text helpers shared by the panels.

Each request gets one colour, by arrival order, used everywhere it appears
(pool cells, block tables, queues), so the eye can follow it between panels.
"""

from __future__ import annotations

from nanoserve.trace import ViewState
from nanoserve.viz.text import shown as printable  # noqa: F401 -- one rendering of text for every panel

# Background colours for request cells; black text reads well on all of them.
REQUEST_COLOURS = (
    "#61afef", "#98c379", "#e5c07b", "#c678dd", "#56b6c2", "#e06c75",
    "#d19a66", "#7fdbca", "#f78fb3", "#b5bd68", "#82aaff", "#ffcb6b",
)
FREE = "#3a3a3a"            # a free block (ref count 0)
SHARED = "#ffffff"          # a block in the tables of more than one request (ref count > 1)
CACHED = "#5f5f87"          # a block only the radix cache holds: reusable by a hit, or evicted for room
HELD = "#888888"            # held, but by no request we know
CPU = "#4e4e4e"             # a free CPU (swap) block
TOUCHED = "bold underline"  # allocated or freed this step
CURSOR = "reverse"          # the selected block

STATUS_STYLE = {
    "waiting": "yellow", "running": "green", "swapped": "#c678dd", "finished_stopped": "dim",
    "finished_length": "dim", "finished_aborted": "red", "finished_pruned": "dim",
}
# radix-tree nodes marked this step
HIT = "bold #000000 on #e5c07b"       # a prefix lookup matched through it
NEW = "bold #000000 on #98c379"       # inserted
EVICTED = "strike #e06c75"            # evicted (drawn once, under its former parent)


def request_colours(state: ViewState) -> dict[str, str]:
    """Request id -> its colour, by arrival order (stable over a run and its replay)."""
    return {rid: REQUEST_COLOURS[i % len(REQUEST_COLOURS)] for i, rid in enumerate(state.sequences)}
