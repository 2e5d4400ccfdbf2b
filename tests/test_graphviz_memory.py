"""Graphviz pictures of the memory mechanisms (radix tree, shared / cached blocks, CPU swap pool),
checked on the DOT source of the hand-written trace in `memory_events.py`; no engine, no `dot`."""

from __future__ import annotations

import re

import pytest
from memory_events import memory_state

from nanoserve.viz.graphviz import CACHED_FILL, SHARED_FILL, TOUCHED_LINE, pool_dot, radix_dot, tables_dot
from nanoserve.viz.radix_dot import LOCKED_LINE, NEW_LINE, span_label


def node_decl(source: str, name: str) -> str:
    lines = [ln for ln in source.splitlines() if ln.strip().startswith(f"{name} [")]
    assert len(lines) == 1, f"node {name} not declared once in:\n{source}"
    return lines[0]


def edges(source: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s*(\w+) -> (\w+)", source, re.MULTILINE))


# -- the radix tree ----------------------------------------------------------------------


def test_radix_tree_shape_and_labels():
    state = memory_state(3)
    source = radix_dot(state)
    assert edges(source) == {("n0", "n1"), ("n1", "n2"), ("n1", "n3")}
    n1 = node_decl(source, "n1")
    assert "“You are a helpful bot.”" in n1 and "blocks #0 #1" in n1 and "node 1 · 8 tokens" in n1
    assert "<B>lock 3</B>" in n1 and "last used step 3" in n1
    # new this step: green outline and a tag; node 1 is locked: blue
    n2 = node_decl(source, "n2")
    assert f'COLOR="{NEW_LINE}"' in n2 and "<B>new</B>" in n2 and ">r1</TD>" in n2
    assert f'COLOR="{LOCKED_LINE}"' in n1
    assert "3 nodes, 4 blocks cached" in source and "hit rate 38% (8/21 tokens)" in source


def test_radix_locks_hits_evictions_and_split():
    source = radix_dot(memory_state(5))
    assert edges(source) == {("n0", "n4"), ("n4", "n1"), ("n1", "n3"), ("n1", "evicted2")}
    n4 = node_decl(source, "n4")
    assert f'BORDER="3" COLOR="{TOUCHED_LINE}"' in n4 and "<B>hit</B>" in n4      # r3 matched it this step
    assert "<B>lock 2</B>" in n4 and "“You are ”" in n4 and ">r3</TD>" in n4
    ghost = node_decl(source, "evicted2")
    assert "dashed" in ghost and "<B>evicted</B> node 2" in ghost and "blocks #2" in ghost
    assert "last used step 3" in ghost
    assert "hit rate 44% (12/27 tokens)" in source


def test_radix_unlocked_nodes_use_the_evictable_fill():
    source = radix_dot(memory_state(6))
    for nid in (1, 3):
        line = node_decl(source, f"n{nid}")
        assert f'BGCOLOR="{CACHED_FILL}"' in line and "lock 0 · evictable" in line
    assert 'BGCOLOR="#ffffff"' in node_decl(source, "n4")                     # r3 still holds node 4


def test_radix_empty_tree_and_awkward_text():
    source = radix_dot(memory_state(0))
    assert "nothing cached yet" in source and "no lookups yet" in source
    assert span_label('a <b> & "c"\nd') == "“a &lt;b&gt; &amp; &quot;c&quot;⏎d”"
    assert span_label("x" * 50).endswith("…”") and len(span_label("x" * 50)) == 34


def test_radix_off_is_a_clear_error():
    state = memory_state(2)
    state.prefix_caching = False
    with pytest.raises(ValueError, match="no radix tree: prefix caching was off"):
        radix_dot(state)


# -- pool and tables -------------------------------------------------------------------------

CELL = re.compile(r'<TD WIDTH="\d+" HEIGHT="\d+" BGCOLOR="([^"]+)"[^>]*><B>#(\d+)</B><BR/>(.*?)</TD>')


def test_pool_kinds_shared_cached_and_cpu_pool():
    state = memory_state(4)
    source = pool_dot(state)
    cells = {int(b): (fill, caption) for fill, b, caption in CELL.findall(node_decl(source, "grid"))}
    assert cells[0] == (SHARED_FILL, "<B>shared ×3</B>")                       # r2, r2.1 and the tree
    assert cells[2] == (CACHED_FILL, "cached")                                 # only the tree: evictable
    assert cells[5][1] == "r2" and cells[4][1].startswith('<FONT COLOR="#969696">free')
    assert "cached, evictable" in node_decl(source, "legend")
    cpu = node_decl(source, "cpu_pool")
    assert "3/6 used" in cpu and cpu.count("r1</TD>") == 3 and "c5<BR/>&nbsp;" in cpu
    assert "1 swapped" in source


def test_pool_marks_a_request_block_the_tree_also_holds():
    state = memory_state(1)
    cells = {int(b): caption for _, b, caption in CELL.findall(node_decl(pool_dot(state), "grid"))}
    assert cells[0] == 'r1<FONT POINT-SIZE="8"> +tree</FONT>' and cells[2] == "r1"


def test_tables_show_ref_counts_cached_blocks_and_swapped_requests():
    source = tables_dot(memory_state(4))
    physical = node_decl(source, "physical")
    assert "ref 3 · shared · cached" in physical and "ref 1 · cached" in physical
    assert re.search(rf'PORT="p2" BGCOLOR="{CACHED_FILL}"', physical)
    swapped = node_decl(source, "swapped")
    assert "swapped out" in swapped and ">r1</TD><TD>CPU 0 1 2</TD>" in swapped
    assert "r1" not in node_decl(source, "no_blocks")                         # r3 waits, r1 is on the CPU
