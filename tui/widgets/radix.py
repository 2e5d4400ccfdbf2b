"""The radix tree of the prefix cache, as a Textual `Tree`.

One tree node per cache node: its text span (a path from the root spells a
cached prefix), its lock count (live requests holding it or a node below it:
it cannot be evicted while locked), its physical blocks and the step it was
last used. Unlocked nodes are drawn in the "cached" colour of the pool grid:
their blocks are the evictable ones. This step's hits and new nodes are
highlighted; nodes evicted this step stay for one frame, struck through,
under their former parent.

Drawn from a `ViewState` only; `node_label` and `root_label` are plain
functions so tests can call them without an app.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Tree

from nanoserve.trace import ROOT, RadixNodeView, ViewState
from nanoserve_tui.palette import EVICTED, HIT, NEW, printable

SPAN = 22          # characters of a node's text shown
MAX_NODES = 200    # a big run's tree is cut here ("… N more"): rebuilding 200 nodes costs ~6 ms
OFF = "prefix caching is off"
DIM, LOCKED = Style(dim=True), Style.parse("bold")
UNLOCKED = Style.parse("#8787d7")   # the pool's "cached" hue, lighter to read as text: evictable


def span(text: str, limit: int = SPAN) -> str:
    """A node's text, quoted, one cell per character, cut to `limit` characters."""
    shown = printable(text)
    return "“" + (shown if len(shown) <= limit else shown[:limit - 1] + "…") + "”"


def node_label(state: ViewState, node: RadixNodeView, lock: int, room: int | None = None) -> Text:
    """`“You are a helpful” lock 2 [0 1] @5`, styled by lock and this step's marks.

    With `room` (cells), the label fits it: the text span gets shorter first (down to 6
    characters), then the step goes, then the block list is cut short, then left out.
    """
    mark = HIT if node.node_id in state.hit_nodes else NEW if node.node_id in state.inserted_nodes else None
    status = f" lock {lock}" if lock else " evictable"   # (not "free": its blocks hold cached K/V)
    blocks, step = f" [{' '.join(map(str, node.block_ids))}]", f" @{node.last_access}"
    limit = SPAN
    if room is not None:
        if room - len(status + blocks + step) - 2 < 6:
            step = ""
        if room - len(status + blocks) - 2 < 6 and len(node.block_ids) > 1:
            blocks = f" [{node.block_ids[0]} …]"
        if room - len(status + blocks) - 2 < 3:          # very narrow: the text and the lock matter most
            blocks = ""
        limit = max(1, min(SPAN, room - len(status + blocks + step) - 2))
    text = Text(span(node.text, limit), Style.parse(mark) if mark else LOCKED if lock else UNLOCKED)
    text.append(status, Style.parse("#56b6c2") if lock else DIM)
    text.append(blocks + step, DIM)
    return text


def evicted_label(node: RadixNodeView, room: int | None = None) -> Text:
    """`“Hi Hello x” evicted [2]`: a node gone this step, drawn once where it was; fits `room` cells."""
    tail = f" evicted [{' '.join(map(str, node.block_ids))}]"
    if room is not None and room - len(tail) - 2 < 6:
        tail = " evicted"
    limit = SPAN if room is None else max(1, min(SPAN, room - len(tail) - 2))
    return Text.assemble((span(node.text, limit), Style.parse(EVICTED)), (tail, Style.parse("#e06c75")))


def root_label(state: ViewState, room: int | None = None) -> Text:
    """`root 16 nodes, 17 blocks · hit 27%`, shorter when `room` (cells) asks for it."""
    if not state.prefix_caching:
        return Text("root", DIM)
    nodes = state.radix_nodes()
    rate = state.cache_hit_rate()
    hit = "–" if rate is None else f"{rate:.0%}"
    blocks = sum(len(n.block_ids) for n in nodes)
    for detail in (f" {len(nodes)} nodes, {blocks} blocks · hit {hit}", f" {len(nodes)} nodes · hit {hit}",
                   f" {len(nodes)} nodes"):
        if room is None or 4 + len(detail) <= room:
            break
    return Text.assemble(("root", "bold"), (detail, DIM))


def signature(state: ViewState, locks: dict[int, int]) -> tuple:
    """Everything the tree shows; the tree is rebuilt only when this changes."""
    return (state.prefix_caching, state.cache_hit_tokens, state.cache_lookup_tokens,
            tuple((n.node_id, n.parent_id, n.text, tuple(n.block_ids), n.last_access, locks[n.node_id])
                  for n in state.radix_nodes()),
            frozenset(state.hit_nodes), frozenset(state.inserted_nodes), tuple(state.evicted_nodes))


class RadixTree(Tree[int]):
    """The cache's tree; node data is the cache node id."""

    state: reactive[ViewState | None] = reactive(None, always_update=True)

    def __init__(self, **kwargs) -> None:
        super().__init__("root", **kwargs)
        self.show_root = True
        self.guide_depth = 2
        self._shown: tuple | None = None
        self.root.expand()

    def on_resize(self) -> None:
        self.watch_state(self.state)

    def watch_state(self, state: ViewState | None) -> None:
        if state is None:
            return
        locks = state.lock_counts()
        width = self.scrollable_content_region.width
        key = (width, signature(state, locks))
        if key == self._shown:
            return
        self._shown = key
        self.clear()
        self.root.set_label(root_label(state, room=width - 3 if width else None))
        if not state.prefix_caching:
            self.root.add_leaf(Text(OFF, DIM))
            return
        branch = {ROOT: self.root}
        nodes = state.radix_nodes()
        for node in nodes[:MAX_NODES]:
            parent = branch.get(node.parent_id, self.root)
            indent = 2 * len(state.radix_path(node.node_id)) + 2    # tree guides and the expand arrow
            label = node_label(state, node, locks[node.node_id], room=width - indent - 1 if width else None)
            branch[node.node_id] = parent.add(label, data=node.node_id, expand=True, allow_expand=bool(node.children))
        for node in state.evicted_nodes.values():
            indent = 2 * (len(state.radix_path(node.parent_id)) + 1) + 2
            branch.get(node.parent_id, self.root).add_leaf(
                evicted_label(node, room=width - indent - 1 if width else None), data=node.node_id)
        if len(nodes) > MAX_NODES:
            self.root.add_leaf(Text(f"… {len(nodes) - MAX_NODES} more nodes", DIM))
        if not nodes and not state.evicted_nodes:
            self.root.add_leaf(Text("empty: nothing cached yet", DIM))

    @property
    def text(self) -> str:
        """Every node's label as plain text, indented by depth (what tests compare)."""
        lines = []

        def walk(node, depth):
            lines.append("  " * depth + str(node.label))
            for child in node.children:
                walk(child, depth + 1)
        walk(self.root, 0)
        return "\n".join(lines)
