"""The pool panel's words: one block's details, the colour key, the CPU swap strip.

`describe_block` answers "what is in block 7?" (ref count, the requests whose
tables hold it and which token positions, the radix node holding it);
`legend` is the colour key under the grid; `cpu_strip` draws the CPU swap
pool in one line. Plain functions of a `ViewState`, used by `pool.py`.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text

from nanoserve.trace import ViewState
from nanoserve_tui.palette import CACHED, CPU, FREE, SHARED, request_colours


def token_span(state: ViewState, request_id: str, block_id: int) -> str:
    """Which token positions `block_id` holds for one request, e.g. "logical 2, tokens 8-10 (3/4)"."""
    req, bs = state.sequences[request_id], state.block_size
    g, i = req.locate(block_id)
    group = f"group {g}, " if g else ""          # KV cache groups (kv_groups.py): which table holds it
    filled = max(0, min(bs, req.num_computed_tokens - i * bs))
    if filled == 0:
        return f"{group}logical {i}, reserved (no KV yet, 0/{bs})"
    return f"{group}logical {i}, tokens {i * bs}-{i * bs + filled - 1} ({filled}/{bs})"


def describe_block(state: ViewState, block_id: int, rank=None) -> Text:
    """A few lines about one block: ref count, owners, token positions (and, with tensor parallelism,
    what the selected `rank`'s copy of it holds)."""
    ref = state.ref_counts[block_id]
    text = Text()
    text.append(f"block {block_id}", "bold")
    if rank is not None:
        heads = ",".join(map(str, rank.kv_heads))
        text.append(f" · on rank {rank.rank}: K/V of KV heads {heads}, {rank.bytes_per_block} bytes")
    if ref == 0:
        pos = state.free_queue.index(block_id) if block_id in state.free_queue else -1
        text.append(f" · free · position {pos} in the free queue (0 = next allocated)")
        return text
    owners = state.block_owners().get(block_id, [])
    node = state.cached_blocks().get(block_id)
    text.append(f" · ref count {ref}" + (" · shared" if len(owners) > 1 else ""))
    if node is not None:
        lock = state.lock_counts()[node]
        text.append(f" · in radix node {node} (one ref), " + (f"locked by {lock}" if lock else
                                                               "unlocked: evictable" if not owners else "unlocked"))
    # One line for the owners (the panel has room for two): owners holding the same positions share them,
    # as the requests sharing a prompt's blocks do.
    colours, spans = request_colours(state), {}
    for rid in owners:
        spans.setdefault(token_span(state, rid, block_id), []).append(rid)
    if spans:
        text.append("\n")
    for i, (span, rids) in enumerate(spans.items()):
        text.append("  ·  " if i else " ")
        for rid in rids:
            text.append(f" {rid} ", Style.parse(f"#000000 on {colours[rid]}"))
            text.append(" ")
        text.append(span)
    return text


def legend(state: ViewState | None, width: int | None = None) -> Text:
    """The colour key; "cached" only when the engine has a prefix cache. With `width` (cells), the widest
    of its forms that fits: whole, then with shorter words, then the colours' names alone."""
    cached = state is not None and state.prefix_caching
    forms = []
    for cell, gap, request, step in (("  ", "  ", " per request  ", " = this step"),
                                     ("  ", " ", " request ", "=this step"), ("  ", " ", " request", None),
                                     (" ", " ", " request", None)):
        parts = [(cell, Style.parse(f"on {FREE}")), f" free{gap}", (cell, Style.parse(f"on {SHARED}")),
                 f" shared{gap}"]
        if cached:
            parts += [(cell, Style.parse(f"on {CACHED}")), f" cached{gap}"]
        parts += [(cell, Style.parse("on #61afef")), (cell, Style.parse("on #98c379")), request]
        if step is not None:
            parts += [("underlined", Style.parse("bold underline")), step]
        forms.append(Text.assemble(*parts))
    return next((f for f in forms if width is None or f.cell_len <= width), forms[-1])


def cpu_strip(state: ViewState, colours: dict[str, str], width: int) -> Text:
    """The CPU swap pool in one line: a cell per CPU block, in the colour of the swapped request holding it."""
    holder = {b: rid for rid in state.swapped for b in state.sequences[rid].cpu_block_table}
    text = Text.assemble(("CPU swap ", "bold"), (f"{len(holder)}/{state.num_cpu_blocks} ", "dim"))
    room = width - text.cell_len
    # the roomiest look that fits: 2-wide cells with gaps, without gaps, then 1 wide (and "…")
    cell, gap = next(((c, g) for c, g in ((2, 1), (2, 0)) if (c + g) * state.num_cpu_blocks <= room), (1, 0))
    shown = max(0, min(state.num_cpu_blocks, room // (cell + gap)))
    for b in range(shown):
        text.append(" " * cell, Style.parse(f"on {colours[holder[b]] if b in holder else CPU}"))
        text.append(" " * gap)
    if shown < state.num_cpu_blocks:
        text.append("…", "dim")
    return text
