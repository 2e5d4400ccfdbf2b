"""Across processes, under the pool grid: the ranks of tensor parallelism and the KV handoffs received.

With tensor parallelism every rank keeps its own KV pool, with the same
block tables (so the grid above is the same on every rank) holding only
its own KV heads. The bar shows one chip per rank (its KV heads, what it
wrote, copied and swapped this step; ✓ when every rank's slot ledger has the
same digest, i.e. the pools hold the same tokens in the same slots), the
selected rank highlighted (`k` switches), then this step's collectives (kind,
calls, bytes). With disaggregation it lists the latest KV handoffs into this
engine's pool: which request, from which blocks of the sender's pool to which
of ours.

`ranks_text` is a plain function of a `ViewState`, for tests and benchmarks.
"""

from __future__ import annotations

from rich.text import Text

from nanoserve.trace import ViewState

SELECTED = "bold #000000 on #e5c07b"
CHIP = "#000000 on #82aaff"
MAX_TRANSFERS = 2        # handoffs listed (the newest first)


def size(num_bytes: float) -> str:
    """1536 -> "1.5KiB"."""
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024 or unit == "MiB":
            return f"{num_bytes:.0f}{unit}" if unit == "B" else f"{num_bytes:.1f}{unit}"
        num_bytes /= 1024
    return ""


def _work(r) -> str:
    """What a rank did to its pool last step, e.g. "4 blocks written, 1 copied"."""
    parts = [f"{n} {what}" for what, n in (("written", r.num_blocks_written), ("copied", r.num_blocks_copied),
                                           ("swapped", r.num_blocks_swapped)) if n]
    return (parts[0].replace(" ", " blocks ", 1) + "".join(", " + p for p in parts[1:])) if parts else "idle"


def _ids(ids) -> str:
    ids = list(ids)
    return " ".join(map(str, ids[:6])) + (" …" if len(ids) > 6 else "")


def rank_title(state: ViewState, selected: int) -> str:
    """The pool panel's title when ranks exist: whose pool the grid stands for."""
    r = state.ranks[selected]
    heads = ",".join(map(str, r.kv_heads)) or "?"
    return (f"KV block pool · rank {r.rank} of {len(state.ranks)} · KV heads {heads} · "
            f"{size(r.bytes_per_block)} of each block")


def ranks_text(state: ViewState, selected: int = 0) -> Text:
    """A few lines: the ranks, their work and collectives this step, the latest KV handoffs."""
    lines: list[Text] = []
    if state.ranks:
        line = Text.assemble(("ranks ", "bold"))
        for r in state.ranks:
            line.append(f" {r.rank} · KV heads {','.join(map(str, r.kv_heads))} ",
                        SELECTED if r.rank == selected else CHIP)
            line.append(" ")
        if len({r.digest for r in state.ranks}) == 1 and state.ranks[0].digest:
            line.append(" same slots ✓", "green")
        lines.append(line)
        work = {r.rank: _work(r) for r in state.ranks}
        if len(set(work.values())) == 1:
            lines.append(Text.assemble(("this step ", "bold"), (f"each rank {work[0]}", "dim")))
        else:
            lines.append(Text.assemble(("this step ", "bold"),
                                       (" · ".join(f"rank {r} {w}" for r, w in work.items()), "dim")))
        # Kind, calls and bytes (their times are in the CollectiveOps events: a width that changed with
        # every step would make the line wrap differently from one step to the next).
        ops = " · ".join(f"{kind}×{count} {size(num_bytes)}" for kind, count, num_bytes, _ in state.collectives)
        lines.append(Text.assemble(("collectives ", "bold"), (ops or "none this step", "dim")))
    if state.transfers:
        line = Text.assemble(("KV in ", "bold"))
        for t in reversed(state.transfers[-MAX_TRANSFERS:]):
            line.append(f" {t.request_id} ", CHIP)
            line.append(f" {t.src}[{_ids(t.src_block_ids)}] → [{_ids(t.block_ids)}] {t.num_tokens} tok "
                        f"{size(t.num_bytes)} @{t.step}  ", "dim")
        lines.append(line)
    return Text("\n").join(lines)
