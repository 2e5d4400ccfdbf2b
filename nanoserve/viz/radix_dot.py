"""Graphviz picture of the radix prefix cache: the tree of cached token spans.

This module owns `radix_tree_dot(state)` (`graphviz.BUILDERS["radix"]`,
and `nanoserve export --what radix`). Each node is one span of whole blocks
under its parent; a path from the root spells a cached prefix. A node shows
its text, its physical blocks, its lock count (how many live requests hold it
or a node below it, so it cannot be evicted) and the step it was last used.

    locked (lock > 0)       white box, thick blue border, the holders named
    unlocked                the "cached, evictable" fill of the pool picture
    hit this step           red outline        new this step   green outline
    evicted this step       dashed grey ghost, under its former parent

Like the rest of viz/, it reads a `ViewState` only.
"""

from __future__ import annotations

import html

from nanoserve.view import ROOT, ViewState
from nanoserve.viz.dot_style import CACHED_FILL, TOUCHED_LINE, colours_of, graph, html_table
from nanoserve.viz.text import shown

LOCKED_LINE = "#08519c"
NEW_LINE = "#238b45"
GHOST = "#969696"
SPAN_CHARS = 32          # text shown per node before "…"


def span_label(text: str, limit: int = SPAN_CHARS) -> str:
    """A span's text for an HTML label: quoted, newlines visible, escaped, cut at `limit` characters."""
    text = shown(text)
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return html.escape(f"“{text}”")


def _no_tree(state: ViewState) -> None:
    if not state.prefix_caching:
        raise ValueError("this trace has no radix tree: prefix caching was off in the engine that recorded it "
                         "(turn it on with EngineConfig(enable_prefix_caching=True), or a scenario that uses it)")


def radix_tree_dot(state: ViewState) -> str:
    """The radix tree as DOT source; ValueError when the trace had prefix caching off."""
    _no_tree(state)
    nodes, locks, colours = state.radix_nodes(), state.lock_counts(), colours_of(state)
    num_cached = sum(len(n.block_ids) for n in nodes)
    rate = state.cache_hit_rate()
    hits = "no lookups yet" if rate is None else (
        f"hit rate {rate:.0%} ({state.cache_hit_tokens}/{state.cache_lookup_tokens} tokens)")
    g = graph("radix", f"step {state.step} · radix tree · {len(nodes)} nodes, {num_cached} blocks cached · {hits}",
               rankdir="LR")
    g.attr(ranksep="0.35")
    g.node("n0", html_table(['<TR><TD BGCOLOR="#525252"><FONT COLOR="white"><B>root</B></FONT></TD></TR>']))

    # who holds what: a request holds its deepest node (SequenceView.cache_node) and every node above it
    holders: dict[int, list[str]] = {}
    for rid, req in state.sequences.items():
        if not req.status.startswith("finished") and req.cache_node in state.radix and req.cache_node != ROOT:
            holders.setdefault(req.cache_node, []).append(rid)

    for node in nodes:
        lock, nid = locks[node.node_id], node.node_id
        fill = "#ffffff" if lock else CACHED_FILL
        border = (f' BORDER="3" COLOR="{TOUCHED_LINE}"' if nid in state.hit_nodes else
                  f' BORDER="3" COLOR="{NEW_LINE}"' if nid in state.inserted_nodes else
                  f' BORDER="2" COLOR="{LOCKED_LINE}"' if lock else ' BORDER="1" COLOR="#737373"')
        tags = (["<B>hit</B>"] if nid in state.hit_nodes else []) + (
            ["<B>new</B>"] if nid in state.inserted_nodes else [])
        blocks = " ".join(f"#{b}" for b in node.block_ids)
        who = "".join(f'<TD BGCOLOR="{colours[rid][0]}">{html.escape(rid)}</TD>' for rid in holders.get(nid, []))
        rows = [f'<TR><TD COLSPAN="2" ALIGN="LEFT">{span_label(node.text)}</TD></TR>',
                f'<TR><TD ALIGN="LEFT">node {nid} · {node.num_tokens} tokens</TD><TD>blocks {blocks}</TD></TR>',
                f'<TR><TD ALIGN="LEFT">{"<B>lock " + str(lock) + "</B>" if lock else "lock 0 · evictable"}</TD>'
                f'<TD>last used step {node.last_access}{" · " + " ".join(tags) if tags else ""}</TD></TR>']
        if who:
            rows.append(f'<TR><TD COLSPAN="2"><TABLE BORDER="0" CELLSPACING="2"><TR><TD>held by</TD>{who}'
                        f'</TR></TABLE></TD></TR>')
        g.node(f"n{nid}", f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="3"><TR><TD>'
                          f'<TABLE BGCOLOR="{fill}" CELLBORDER="0" CELLSPACING="0"{border}>{"".join(rows)}'
                          f'</TABLE></TD></TR></TABLE>>')
        g.edge(f"n{node.parent_id}", f"n{nid}", color=LOCKED_LINE if lock else "#737373")

    # nodes evicted this step: ghosts under their former parent (or the root, if that went too)
    for node in state.evicted_nodes.values():
        parent = node.parent_id if node.parent_id in state.radix else ROOT
        label = (f'<TR><TD ALIGN="LEFT"><FONT COLOR="{GHOST}">{span_label(node.text)}</FONT></TD></TR>'
                 f'<TR><TD ALIGN="LEFT"><FONT COLOR="{GHOST}"><B>evicted</B> node {node.node_id} · blocks '
                 f'{" ".join(f"#{b}" for b in node.block_ids)} · last used step {node.last_access}</FONT></TD></TR>')
        g.node(f"evicted{node.node_id}", f'<<TABLE BORDER="1" STYLE="dashed" COLOR="{GHOST}" CELLBORDER="0" '
                                         f'CELLSPACING="0" CELLPADDING="3">{label}</TABLE>>')
        g.edge(f"n{parent}", f"evicted{node.node_id}", style="dashed", color=GHOST)
    if not nodes and not state.evicted_nodes:
        g.node("empty", "<<I>empty: nothing cached yet</I>>")
        g.edge("n0", "empty", style="invis")
    return g.source
