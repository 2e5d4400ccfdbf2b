"""How the engine, a step's result, a request's output and the radix cache look in a Python REPL.

Students meet nanoserve by typing `engine.step()` at a prompt, so the objects
they get back print as compact rich panels: the pool as a strip of block
cells (free, one request's, shared, cached), each request's block table, what
the step did, and the prefix cache as a tree. A plain REPL shows `repr()`, so
`nanoserve.display` renders the same panel into a string (with colours when
the terminal has them). Everything here reads plain snapshot data.

The engine does not import this module: the `@renders(...)` lines register
each panel with `nanoserve.display`, which loads this module the first time
an engine object is shown (see display.py for the seam).
"""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from nanoserve.block_pool import BlockPool
from nanoserve.display import renders
from nanoserve.engine import LLMEngine
from nanoserve.outputs import RequestOutput, StepResult
from nanoserve.radix_cache import RadixCache
from nanoserve.view import implementation_line
from nanoserve.viz.graphviz import engine_svg
from nanoserve.viz.text import shown, token_text

PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
           "bright_green", "bright_yellow", "bright_blue", "bright_red"]


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


POOL_KEY = Text.assemble(("·", "dim"), " free  ", ("■", "cyan"), " a request's (colour)  ",
                         ("▣", "cyan"), " a request's, also cached  ", ("■", "bold white on red"),
                         " shared  ", ("□", "green"), " cached only (evictable)", style="dim")


def render_pool(ref_counts: list[int], owners: dict[int, int], max_cells: int = 512,
                cached: set[int] | frozenset = frozenset(), holders: dict[int, int] | None = None) -> Text:
    """One cell per block: '·' free, '■' in its request's colour, '■' on red when several requests
    share it, '□' when only the prefix cache holds it (evictable), '▣' a request's block the cache holds too.

    owners: block -> index of a request holding it (its colour); cached: blocks in the radix tree;
    holders: block -> how many block tables hold it (None: judge sharing by the ref count alone).
    """
    text = Text()
    for block_id, ref in enumerate(ref_counts[:max_cells]):
        tables = ref if holders is None else holders.get(block_id, 0)
        if ref == 0:
            text.append("·", style="dim")
        elif tables > 1:
            text.append("■", style="bold white on red")
        elif tables == 0 and block_id in cached:
            text.append("□", style="green")
        else:
            text.append("▣" if block_id in cached else "■", style=_colour(owners.get(block_id, 0)))
    if len(ref_counts) > max_cells:
        text.append(f" … +{len(ref_counts) - max_cells} blocks", style="dim")
    return text


@renders(BlockPool)
def render_block_pool(pool):
    """`engine.pool` in a REPL: one cell per block and the free queue head first."""
    snap = pool.snapshot()
    head = Text.assemble(("BlockPool", "bold"), f"  {pool.num_used_blocks}/{pool.num_blocks} used, "
                         f"block_size {pool.block_size}")
    free = snap["free_queue"]
    queue = Text("free queue (next allocated first): ", style="dim")
    queue.append(" ".join(map(str, free[:48])) + (" …" if len(free) > 48 else ""))
    return Panel(Group(head, render_pool(snap["ref_counts"], {}), queue), title="BlockPool",
                 title_align="left", border_style="blue")


@renders(LLMEngine)
def render_engine(engine):
    s = engine.snapshot()
    pool = s["pool"]
    owners: dict[int, int] = {}
    holders: dict[int, int] = {}
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("request", "status", "prompt+out", "computed", "block table"):
        table.add_column(col)
    for i, r in enumerate(s["sequences"]):
        for b in r["block_table"]:
            owners[b] = i
            holders[b] = holders.get(b, 0) + 1
        bt = " ".join(map(str, r["block_table"][:16])) + (" …" if len(r["block_table"]) > 16 else "")
        if r.get("cpu_block_table"):
            bt = "CPU " + " ".join(map(str, r["cpu_block_table"][:16]))
        table.add_row(Text(r["seq_id"], style=_colour(i)), r["status"],
                      f"{r['num_prompt_tokens']}+{r['num_output_tokens']}", str(r["num_computed_tokens"]), f"[{bt}]")
        for g, t in enumerate(r.get("group_tables", ()), 1):   # KV cache groups 1.. (· : left the window)
            for b in (b for b in t if b >= 0):
                owners[b] = i
                holders[b] = holders.get(b, 0) + 1
            cells = " ".join("·" if b < 0 else str(b) for b in t[-16:])
            table.add_row("", f"group {g}", "", "", f"[{'… ' if len(t) > 16 else ''}{cells}]")
    used = pool["num_blocks"] - len(pool["free_queue"])
    swapped = f"  swapped {len(s['swapped'])}" if s.get("swapped") else ""
    head = Text.assemble(
        (f"{s['model']}", "bold"), f"  step {s['step']}  ",
        f"blocks {used}/{pool['num_blocks']} used (block_size {pool['block_size']})  ",
        f"waiting {len(s['waiting'])}  running {len(s['running'])}{swapped}",
    )
    nodes = (s.get("radix") or {}).get("nodes") or []
    cached = {b for n in nodes for b in n["block_ids"]}
    cached |= {c for _, cs in (s.get("radix") or {}).get("companions", ()) for c in cs if c >= 0}   # (groups 1..)
    parts = [head, render_pool(pool["ref_counts"], owners, cached=cached, holders=holders)]
    if s.get("implementation"):   # what computes a step, as it runs (engine.implementation)
        parts.insert(1, Text(implementation_line(s["implementation"]), style="dim"))
    if (s.get("radix") or {}).get("enabled"):
        evictable = sum(r == 1 and b not in owners for b, r in enumerate(pool["ref_counts"]) if b in cached)
        parts.append(Text(f"prefix cache: {len(nodes)} nodes, {len(cached)} blocks cached ({evictable} evictable)"
                          f" · print(engine.radix) for the tree", style="dim"))
    if s.get("cpu_pool"):
        cpu = s["cpu_pool"]
        parts.append(Text(f"CPU swap pool: {cpu['num_blocks'] - len(cpu['free_queue'])}/{cpu['num_blocks']} "
                          "blocks used", style="dim"))
    if s["sequences"]:
        parts.append(table)
    parts.append(POOL_KEY)
    return Panel(Group(*parts), title="LLMEngine", title_align="left", border_style="blue")


@renders(RadixCache)
def render_radix_cache(cache):
    """`engine.radix` in a REPL: the tree drawn from the cache's snapshot."""
    return render_radix(cache.snapshot())


def render_radix(nodes: list[dict]):
    """The radix prefix cache as a tree: one line per node, its text span, blocks, lock count, last use.

    `nodes` are the cache's snapshot dicts (node_id, parent_id, text, num_tokens, block_ids,
    lock_count, last_access), parents before children, the root left out.
    """
    num_blocks = sum(len(n["block_ids"]) for n in nodes)
    evictable = sum(len(n["block_ids"]) for n in nodes if n["lock_count"] == 0)
    tree = Tree(Text.assemble(("root", "bold"), (f"  {len(nodes)} nodes, {num_blocks} blocks cached, "
                                                 f"{evictable} evictable", "dim")), guide_style="dim")
    branch = {0: tree}
    for n in nodes:
        span = shown(n["text"])
        span = span if len(span) <= 40 else span[:39] + "…"
        label = Text.assemble((repr(span), "bold" if n["lock_count"] else "green"),
                              (f"  #{n['node_id']} · {n['num_tokens']} tokens · blocks "
                               f"{' '.join(map(str, n['block_ids']))}", "dim"), "  ")
        label.append(f"lock {n['lock_count']}" if n["lock_count"] else "unlocked, evictable",
                     style="bold cyan" if n["lock_count"] else "green")
        label.append(f"  last used step {n['last_access']}", style="dim")
        parent = branch.get(n["parent_id"], tree)        # parents come first; an orphan hangs off the root
        branch[n["node_id"]] = parent.add(label)
    if not nodes:
        tree.add(Text("(empty: nothing cached yet)", style="dim"))
    return Panel(tree, title="RadixCache", title_align="left", border_style="green")


@renders(StepResult)
def render_step_result(result):
    st = result.stats
    head = Text.assemble(
        (f"step {st.step}", "bold"), f"  {st.num_seqs} seqs  ",
        (f"prefill {st.num_prefill_tokens}", "yellow"), " + ", (f"decode {st.num_decode_tokens}", "green"),
        " tokens  ", f"free blocks {st.num_free_blocks}/{st.num_blocks}  ",
        f"waiting {st.num_waiting}  running {st.num_running}  {st.duration_s * 1000:.1f} ms",
    )
    if st.num_preempted:
        head.append(f"  preempted {st.num_preempted}", style="bold red")
    if st.num_drafted:
        head.append(f"  drafts {st.num_accepted}/{st.num_drafted} accepted", style="bold yellow")
    lines = [head]
    for out in result.outputs:
        for c in out.outputs:        # several with n > 1, forks or beam search
            name = c.seq_id or out.request_id          # the name every panel uses: r1, r1.1, ...
            line = Text(f"  {name}: ", style="bold")
            token = f"token {c.token_ids[-1]} " if c.token_ids else ""
            line.append(f"{token}{token_text(c.delta, c.finish_reason == 'stop')}", style="cyan")
            if c.finish_reason:
                line.append(f"  finished: {c.finish_reason}" + (f" ({c.error})" if c.error else ""), style="magenta")
            lines.append(line)
    kinds: dict[str, int] = {}
    for e in result.events:
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    lines.append(Text("  events: " + ", ".join(f"{k}×{v}" for k, v in kinds.items()), style="dim"))
    return Panel(Group(*lines), title="StepResult", title_align="left", border_style="green")


@renders(RequestOutput)
def render_request_output(out):
    c = out.outputs[0]
    status = c.finish_reason or "running"
    body = Text.assemble((f"{out.request_id}", "bold"), f" [{status}] ",
                         f"{len(out.prompt_token_ids)} prompt + {len(c.token_ids)} output tokens\n")
    if out.prompt:
        body.append(out.prompt, style="dim")
    body.append(c.text, style="cyan")
    return Panel(body, title="RequestOutput", title_align="left", border_style="cyan")


# Jupyter shows the engine's block tables as a Graphviz picture under its panel (None without `dot`).
renders(LLMEngine, kind="svg")(engine_svg)
