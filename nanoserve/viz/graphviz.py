"""Graphviz pictures of the KV cache: block tables, the block pool, the radix prefix tree.

This module owns turning a `ViewState` (what `trace.fold` rebuilds from
events) into DOT source, and rendering that source to SVG/PNG with the `dot`
program. It never looks at engine internals: a recorded trace is enough.

    nanoserve export --trace pressure.jsonl --step 13 --what tables --format svg

* `tables_dot(state)`: each live request's block table, logical block i ->
  the physical block it maps to, one colour per request.
* `pool_dot(state)`: every physical block as a grid cell coloured by who holds
  it (one request, several: shared, only the prefix cache: cached and
  evictable), blocks touched this step outlined, the CPU swap pool when there
  is one, and the free queue from head to tail.
* `radix_dot(state)`: the prefix cache's tree (in `radix_dot.py`).
* `state_at(trace, step)`, `export_trace(...)`: the CLI's `export` command.
* `state_of(engine)`, `engine_svg(...)`: the same pictures of a live engine,
  for the REPL and Jupyter (`_repr_svg_`).

Without `dot` on the PATH we still write the DOT source and say how to get
Graphviz. The `NANOSERVE_DOT` environment variable names another `dot`
program (tests point it at a missing one to exercise that fallback).
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from pathlib import Path

from graphviz import Digraph

from nanoserve.errors import FieldError
from nanoserve.events import StepFinished, StepStarted
from nanoserve.trace import ViewState, fold, synced_event
from nanoserve.trace_check import load_trace
from nanoserve.viz.dot_style import (
    CACHED_FILL,
    FREE_FILL,
    HELD_FILL,
    MAX_POOL_CELLS,
    MAX_QUEUE_IDS,
    SHARED_FILL,
    TOUCHED_LINE,
    colours_of,
    graph,
    html_table,
)
from nanoserve.viz.radix_dot import radix_tree_dot as radix_dot  # the prefix tree has its own module


def _live(state: ViewState) -> list[str]:
    """Requests a picture shows: running first, then waiting, then swapped out (in queue order)."""
    return state.running + state.waiting + state.swapped


def _title(state: ViewState, what: str) -> str:
    swapped = f", {len(state.swapped)} swapped" if state.swapped else ""
    return (f"step {state.step} · {what} · {state.num_blocks} blocks of {state.block_size} tokens · "
            f"{len(state.running)} running, {len(state.waiting)} waiting{swapped}, {len(state.free_queue)} free")


# -- block tables ---------------------------------------------------------------
def tables_dot(state: ViewState) -> str:
    """Each live request's block table with arrows to the physical blocks it maps to."""
    g = graph("tables", _title(state, "block tables"), rankdir="LR")
    colours, owners = colours_of(state), state.block_owners()
    with_blocks = [rid for rid in _live(state) if state.sequences[rid].block_table]
    node = {rid: f"req{i}" for i, rid in enumerate(state.sequences)}  # ids may hold ':' or spaces
    for rid in with_blocks:
        req, (fill, line) = state.sequences[rid], colours[rid]
        rows = [f'<TR><TD BGCOLOR="{line}"><FONT COLOR="white"><B>{html.escape(rid)}</B></FONT></TD>'
                f'<TD BGCOLOR="{line}"><FONT COLOR="white">{req.status}</FONT></TD></TR>',
                f'<TR><TD COLSPAN="2">{req.num_computed_tokens} tokens in KV</TD></TR>']
        for i in range(len(req.block_table)):
            # block i holds tokens [i*bs, (i+1)*bs); only the last one may be partly filled
            held = min(max(req.num_computed_tokens - i * state.block_size, 0), state.block_size)
            rows.append(f'<TR><TD BGCOLOR="{fill}">logical {i}</TD>'
                        f'<TD PORT="b{i}" BGCOLOR="{fill}">{held}/{state.block_size}</TD></TR>')
        rows += _group_rows(state, req, fill)
        g.node(node[rid], html_table(rows))
        for i, block_id in enumerate(req.block_table):
            g.edge(f"{node[rid]}:b{i}:e", f"physical:p{block_id}:w", color=line)
        for k, table in enumerate(req.group_tables, 1):
            for i, block_id in enumerate(table):
                if block_id >= 0:
                    g.edge(f"{node[rid]}:g{k}b{i}:e", f"physical:p{block_id}:w", color=line, style="dashed")
    # waiting requests without blocks (new, or preempted) share one small box
    no_blocks = [rid for rid in state.running + state.waiting if rid not in with_blocks]
    if no_blocks:
        names = "".join(f'<TD BGCOLOR="{colours[rid][0]}">{html.escape(rid)}</TD>' for rid in no_blocks)
        g.node("no_blocks", html_table([f'<TR><TD BORDER="0"><I>waiting, no blocks:</I></TD>{names}</TR>'],
                                        spacing=2))
    # swapped-out requests: their KV sits in the CPU pool, no device blocks
    if state.swapped:
        rows = [f'<TR><TD BGCOLOR="{colours[rid][0]}">{html.escape(rid)}</TD><TD>CPU '
                f'{" ".join(map(str, state.sequences[rid].cpu_block_table))}</TD></TR>' for rid in state.swapped]
        g.node("swapped", html_table(['<TR><TD COLSPAN="2" BORDER="0"><I>swapped out, KV in the CPU pool:</I>'
                                       '</TD></TR>'] + rows))
    # keep the requests top to bottom in queue order (running first)
    column = ([node[rid] for rid in with_blocks] + (["no_blocks"] if no_blocks else [])
              + (["swapped"] if state.swapped else []))
    with g.subgraph() as same:
        same.attr(rank="same")
        for a, b in zip(column, column[1:]):
            same.edge(a, b, style="invis")

    # one column of the physical blocks in use, by id, with their reference counts
    # (a block in the radix tree counts one reference for the tree: "cached")
    rows = ['<TR><TD COLSPAN="2"><B>physical blocks</B></TD></TR>']
    kinds, cached = state.block_kinds(owners), state.cached_blocks()
    for block_id, ref in enumerate(state.ref_counts):
        if ref == 0 and block_id not in owners:
            continue
        fill = _fill(kinds[block_id], owners.get(block_id), colours)
        tree = " · cached" if block_id in cached else ""
        note = f"<B>ref {ref} · shared{tree}</B>" if kinds[block_id] == "shared" else f"ref {ref}{tree}"
        rows.append(f'<TR><TD PORT="p{block_id}" BGCOLOR="{fill}"><B>#{block_id}</B></TD>'
                    f'<TD BGCOLOR="{fill}">{note}</TD></TR>')
    if len(rows) == 1:
        rows.append('<TR><TD COLSPAN="2"><I>none in use</I></TD></TR>')
    g.node("physical", html_table(rows))
    return g.source


def _group_rows(state: ViewState, req, fill: str) -> list[str]:
    """KV cache groups 1.. (kv_groups.py): each group's table under group 0's; a logical block whose
    block left the group's sliding window is drawn empty ("left the window": back in the pool)."""
    rows = []
    for k, table in enumerate(req.group_tables, 1):
        window = state.kv_groups[k][0] if k < len(state.kv_groups) else 0
        rows.append(f'<TR><TD COLSPAN="2"><I>group {k}' + (f" · window {window}" if window else "") + "</I></TD></TR>")
        for i, block_id in enumerate(table):
            held = min(max(req.num_computed_tokens - i * state.block_size, 0), state.block_size)
            cell = (f'<TD PORT="g{k}b{i}" BGCOLOR="{fill}">{held}/{state.block_size}</TD>' if block_id >= 0
                    else f'<TD BGCOLOR="{FREE_FILL}"><FONT COLOR="#969696">left the window</FONT></TD>')
            rows.append(f'<TR><TD>logical {i}</TD>{cell}</TR>')
    return rows


def _fill(kind: str, holders: list[str] | None, colours: dict[str, tuple[str, str]]) -> str:
    """A block's fill colour from its kind (`ViewState.block_kinds`)."""
    if kind == "owned":
        return colours[holders[0]][0]
    return {"free": FREE_FILL, "shared": SHARED_FILL, "cached": CACHED_FILL}.get(kind, HELD_FILL)


# -- the pool -------------------------------------------------------------------
def pool_dot(state: ViewState, columns: int | None = None) -> str:
    """The pool as a grid of blocks by state, this step's blocks outlined, then the free queue."""
    g = graph("pool", _title(state, "block pool"), rankdir="TB")
    g.attr(ranksep="0.25")
    colours, owners = colours_of(state), state.block_owners()
    columns = columns or (10 if state.num_blocks <= 100 else 16)
    shown = min(state.num_blocks, MAX_POOL_CELLS)
    kinds, cached = state.block_kinds(owners), state.cached_blocks()
    cells = []
    for block_id in range(shown):
        ref, holders, kind = state.ref_counts[block_id], owners.get(block_id, []), kinds[block_id]
        fill = _fill(kind, holders, colours)
        if kind == "free":
            who = '<FONT COLOR="#969696">free</FONT>'
        elif kind == "shared":
            who = f"<B>shared ×{ref}</B>"
        elif kind == "owned":   # one request; "+tree" when the prefix cache holds it too
            who = html.escape(holders[0]) + ('<FONT POINT-SIZE="8"> +tree</FONT>' if block_id in cached else "")
        else:
            who = "cached" if kind == "cached" else f"held ×{ref}"
        if block_id in state.left_window and kind in ("free", "cached"):   # a sliding window passed it
            who = "← window"
        outline = (f' BORDER="3" COLOR="{TOUCHED_LINE}"' if block_id in state.touched_blocks
                   else ' COLOR="#737373"')
        cells.append(f'<TD WIDTH="52" HEIGHT="40" BGCOLOR="{fill}"{outline}><B>#{block_id}</B><BR/>{who}</TD>')
    rows = ["<TR>" + "".join(cells[i:i + columns]) + "</TR>" for i in range(0, len(cells), columns)]
    if shown < state.num_blocks:
        rows.append(f'<TR><TD COLSPAN="{columns}" BORDER="0">… and {state.num_blocks - shown} more blocks</TD></TR>')
    g.node("grid", html_table(rows, spacing=3))

    # legend: one swatch per live request, then the special states
    swatches = [(colours[rid][0], html.escape(rid), "") for rid in _live(state)]
    swatches += [(SHARED_FILL, "shared", "")]
    if state.prefix_caching:
        swatches += [(CACHED_FILL, "cached, evictable", "")]
    swatches += [(FREE_FILL, "free", ""), (FREE_FILL, "touched this step", f' BORDER="3" COLOR="{TOUCHED_LINE}"')]
    if state.kv_groups:   # KV cache groups: what "← window" means
        swatches += [(FREE_FILL, "← window: left a sliding window this step", "")]
    legend = "".join(f'<TD BGCOLOR="{fill}"{extra}>{text}</TD>' for fill, text, extra in swatches)
    g.node("legend", html_table([f'<TR><TD BORDER="0"><B>legend</B></TD>{legend}</TR>'], spacing=4))

    # the free queue: allocation takes from the head, freed blocks join the tail; wrapped at the
    # grid's width so a long queue does not make the picture wider than the pool
    queue = state.free_queue[:MAX_QUEUE_IDS]
    cells = [f'<TD BORDER="0">→</TD><TD BGCOLOR="{FREE_FILL}">{b}</TD>' for b in queue]
    hidden = len(state.free_queue) - len(queue)
    lines = (["".join(cells[i:i + columns]) for i in range(0, len(cells), columns)]
             or ['<TD BORDER="0"><I>(empty)</I></TD>'])
    lines[-1] += (f'<TD BORDER="0">→ … {hidden} more</TD>' if hidden else "") + '<TD BORDER="0">→ <B>tail</B></TD>'
    labels = ['<TD BORDER="0"><B>free queue: head</B></TD>'] + ['<TD BORDER="0"></TD>'] * (len(lines) - 1)
    g.node("free_queue", html_table([f'<TR>{label}{line}</TR>' for label, line in zip(labels, lines)], spacing=2))
    g.edge("legend", "grid", style="invis")
    g.edge("grid", "free_queue", style="invis")
    if state.num_cpu_blocks:
        _cpu_pool(g, state, colours, columns)
    return g.source


def _cpu_pool(g: Digraph, state: ViewState, colours: dict[str, tuple[str, str]], columns: int) -> None:
    """The CPU swap pool under the free queue: each CPU block coloured by the swapped request it holds."""
    holder = {b: rid for rid in state.swapped for b in state.sequences[rid].cpu_block_table}
    cells = [f'<TD WIDTH="40" BGCOLOR="{colours[holder[b]][0] if b in holder else FREE_FILL}">'
             f'c{b}<BR/>{html.escape(holder.get(b, "")) or "&nbsp;"}</TD>'
             for b in range(min(state.num_cpu_blocks, MAX_POOL_CELLS))]
    rows = ["<TR>" + "".join(cells[i:i + columns]) + "</TR>" for i in range(0, len(cells), columns)]
    title = (f'<TR><TD COLSPAN="{min(columns, len(cells))}" BORDER="0"><B>CPU swap pool</B>: '
             f'{len(holder)}/{state.num_cpu_blocks} used</TD></TR>')
    g.node("cpu_pool", html_table([title] + rows, spacing=2))
    g.edge("free_queue", "cpu_pool", style="invis")


BUILDERS = {"tables": tables_dot, "pool": pool_dot, "radix": radix_dot}
FORMATS = ("svg", "png", "dot")


# -- traces -> state, DOT -> files -------------------------------------------------
def state_at(trace_path: str | Path, step: int | None = None) -> ViewState:
    """The view state after step `step` of a trace (None: the end; 0: before the first step)."""
    path = Path(trace_path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path} (write one with "
                                f"`nanoserve record --scenario memory-pressure -o {path.name}`)")
    events = load_trace(path)                      # ValueError naming the line and field of a bad event
    last = max((e.step for e in events if isinstance(e, StepFinished)), default=0)
    if step is not None and not 0 <= step <= last:
        raise ValueError(f"step {step} is not in {path}: its steps run from 0 to {last}")
    state = None
    try:
        for event in events:
            if step == 0 and isinstance(event, StepStarted):
                break                              # step 0: the state before anything ran
            state = fold(state, event)
            if step is not None and isinstance(event, StepFinished) and event.step == step:
                break
    except (KeyError, IndexError, TypeError, AttributeError, AssertionError) as exc:   # inconsistent events
        raise ValueError(f"{path}: the events do not replay ({type(exc).__name__}: {exc})") from None
    if state is None:
        raise ValueError(f"{path} has no events; a trace starts with EngineSynced")
    return state


def dot_program() -> str | None:
    """Path of the `dot` program ($NANOSERVE_DOT or `dot` on the PATH), None when missing."""
    return shutil.which(os.environ.get("NANOSERVE_DOT", "dot"))


def render(source: str, fmt: str) -> bytes:
    """Run `dot -T<fmt>` on DOT source; RuntimeError with dot's message if it fails."""
    dot = dot_program()
    if dot is None:
        raise RuntimeError("the Graphviz `dot` program is not installed")
    done = subprocess.run([dot, f"-T{fmt}"], input=source.encode(), capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def export_trace(trace: str | Path, step: int | None = None, what: str = "tables", fmt: str = "svg",
                 output: str | Path | None = None) -> Path:
    """Draw `what` at `step` of `trace` into `output` (default: next to the trace); returns the path written."""
    if what not in BUILDERS:
        raise ValueError(f"unknown picture {what!r}; choose one of: {', '.join(BUILDERS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    trace = Path(trace)
    source = BUILDERS[what](state_at(trace, step))
    if output is None:
        output = trace.with_name(f"{trace.stem}-{what}-{'end' if step is None else step}.{fmt}")
    output = Path(output)
    if fmt != "dot" and dot_program() is None:   # fail, and write nothing: a script expecting the file must see it
        raise FieldError("format", f"{fmt} needs Graphviz's `dot` program, which is not installed: "
                                   "apt-get install graphviz (Debian, Ubuntu) or brew install graphviz (macOS); "
                                   "--format dot writes the DOT source without it")
    output.write_bytes(source.encode() if fmt == "dot" else render(source, fmt))
    return output


# -- live engines (REPL, Jupyter) -------------------------------------------------
def state_of(engine) -> ViewState:
    """A live engine's current view state (the same fold a new subscriber starts from)."""
    return state_from_snapshot(engine.snapshot())


def state_from_snapshot(snapshot: dict) -> ViewState:
    """A ViewState from `engine.snapshot()`'s plain data."""
    return fold(None, synced_event(snapshot))


def engine_svg(source, what: str = "tables") -> str | None:
    """SVG text of a ViewState, an engine snapshot dict or a live engine; None without `dot`."""
    if isinstance(source, dict):
        state = state_from_snapshot(source)
    elif isinstance(source, ViewState):
        state = source
    else:
        state = state_of(source)
    if dot_program() is None:
        return None
    return render(BUILDERS[what](state), "svg").decode()
