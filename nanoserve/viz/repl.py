"""How the engine, a step's result and a request's output look in a Python REPL.

Students meet nanoserve by typing `engine.step()` at a prompt, so the objects
they get back print as compact rich panels: the pool as a strip of block
cells, each request's block table, and what the step did. A plain REPL shows
`repr()`, so `to_text` renders the same panel into a string (with colours
when the terminal has them).
"""

from __future__ import annotations

import io
import shutil
import sys

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
           "bright_green", "bright_yellow", "bright_blue", "bright_red"]


def to_text(obj) -> str:
    """Render anything with __rich__ to a string for repr()."""
    buf = io.StringIO()
    width = min(shutil.get_terminal_size((100, 24)).columns, 120)
    console = Console(file=buf, width=width, force_terminal=sys.stdout.isatty(), color_system="auto")
    console.print(obj.__rich__())
    return buf.getvalue().rstrip("\n")


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def render_pool(ref_counts: list[int], owners: dict[int, int], max_cells: int = 512) -> Text:
    """One cell per block: '·' free, a coloured digit/letter per owning request, '2+' shared."""
    text = Text()
    for block_id, ref in enumerate(ref_counts[:max_cells]):
        if ref == 0:
            text.append("·", style="dim")
        elif ref > 1:
            text.append("■", style="bold white on red")
        else:
            text.append("■", style=_colour(owners.get(block_id, 0)))
    if len(ref_counts) > max_cells:
        text.append(f" … +{len(ref_counts) - max_cells} blocks", style="dim")
    return text


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


def to_html(obj) -> str:
    """Render anything with __rich__ to HTML with inline styles (Jupyter's _repr_html_)."""
    console = Console(record=True, width=110, file=io.StringIO())
    console.print(obj.__rich__())
    return console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace\">{code}</pre>")


def render_engine(engine):
    s = engine.snapshot()
    pool = s["pool"]
    owners: dict[int, int] = {}
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("request", "status", "prompt+out", "computed", "block table"):
        table.add_column(col)
    for i, r in enumerate(s["requests"]):
        for b in r["block_table"]:
            owners[b] = i
        bt = " ".join(map(str, r["block_table"][:16])) + (" …" if len(r["block_table"]) > 16 else "")
        table.add_row(Text(r["request_id"], style=_colour(i)), r["status"],
                      f"{r['num_prompt_tokens']}+{r['num_output_tokens']}", str(r["num_computed_tokens"]), f"[{bt}]")
    used = pool["num_blocks"] - len(pool["free_queue"])
    head = Text.assemble(
        (f"{s['model']}", "bold"), f"  step {s['step']}  ",
        f"blocks {used}/{pool['num_blocks']} used (block_size {pool['block_size']})  ",
        f"waiting {len(s['waiting'])}  running {len(s['running'])}",
    )
    parts = [head, render_pool(pool["ref_counts"], owners)]
    if s["requests"]:
        parts.append(table)
    return Panel(Group(*parts), title="LLMEngine", title_align="left", border_style="blue")


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
        c = out.outputs[0]
        line = Text(f"  {out.request_id}: ", style="bold")
        line.append(repr(c.delta) if c.delta else f"+token {c.token_ids[-1] if c.token_ids else '-'}", style="cyan")
        if c.finish_reason:
            line.append(f"  finished: {c.finish_reason}" + (f" ({c.error})" if c.error else ""), style="magenta")
        lines.append(line)
    kinds: dict[str, int] = {}
    for e in result.events:
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    lines.append(Text("  events: " + ", ".join(f"{k}×{v}" for k, v in kinds.items()), style="dim"))
    return Panel(Group(*lines), title="StepResult", title_align="left", border_style="green")


def render_request_output(out):
    c = out.outputs[0]
    status = c.finish_reason or "running"
    body = Text.assemble((f"{out.request_id}", "bold"), f" [{status}] ",
                         f"{len(out.prompt_token_ids)} prompt + {len(c.token_ids)} output tokens\n")
    if out.prompt:
        body.append(out.prompt, style="dim")
    body.append(c.text, style="cyan")
    return Panel(body, title="RequestOutput", title_align="left", border_style="cyan")
