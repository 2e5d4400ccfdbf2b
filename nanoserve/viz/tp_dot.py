"""A Graphviz picture of tensor parallelism: how one layer's weights and one request's KV are split.

    from nanoserve.distributed.sharding import split_plan
    from nanoserve.viz.tp_dot import split_dot
    dot = split_dot(split_plan(model, 2), request=engine.snapshot()["sequences"][0], block_size=16)

One column per rank, top to bottom in the order a token's hidden state
meets them: the vocab-parallel embedding, the column-parallel projections
(each labelled with the rows, i.e. heads, it keeps), attention over the
rank's own heads reading its own KV cache, the row-parallel output
projection, the MLP, the vocab-parallel LM head. Between the columns, the
collectives that join them (all-reduce, gather). Under each attention node,
the request's block table as that rank's pool holds it: the same block ids
on every rank, each holding only the rank's KV heads.

Everything is read from the real shards: `sharding.split_plan` splits the
model as the engine does and describes each rank's shard as plain data, which
is all this viewer reads, so the picture cannot disagree with the code.
"""

from __future__ import annotations

import html

from graphviz import Digraph

FONT = "Helvetica"
RANK_FILL = ["#c6dbef", "#c7e9c0", "#dadaeb", "#fdd0a2"]
COLLECTIVE = "#ffd92f"


def _runs(owned) -> str:
    """((0, 32), (64, 96)) -> "0–31, 64–95"; a run of one is just its number."""
    return ", ".join(f"{a}–{b - 1}" if b - a > 1 else f"{a}" for a, b in owned)


def _label(w: dict, head_dim: int) -> str:
    """One weight's box: name, shape of this rank's slice of the full shape, what it owns."""
    full = "×".join(map(str, w["full"]))
    mine = "×".join(map(str, w["shape"]))
    owned = _runs(w["owned"])
    if w["kind"] == "column":
        what = f"rows {owned}"
        if w["name"] in ("q_proj", "k_proj", "v_proj"):     # rows come in heads of head_dim
            heads = [(a // head_dim, b // head_dim) for a, b in w["owned"]]
            what += f" (head{'s' if heads[0][1] - heads[0][0] > 1 else ''} {_runs(heads)})"
        elif w["name"] == "qkv":                            # GPT-2: [q heads | k heads | v heads]
            a, b = w["owned"][0]
            what += f" (heads {_runs(((a // head_dim, b // head_dim),))} of q, k and v)"
        split = "column-parallel"
    elif w["kind"] == "row":
        what, split = f"columns {owned}", "row-parallel"
    else:
        what, split = f"token ids {owned}", "vocab-parallel"
    return (f'<<B>{html.escape(w["name"])}</B> <FONT POINT-SIZE="9">{split}</FONT><BR/>'
            f'{mine} of {full}<BR/><FONT POINT-SIZE="9">{what}</FONT>>')


def _kv_table(rank: int, kv_heads: tuple[int, ...], request: dict | None, block_size: int, num_blocks: int,
              head_dim: int, num_layers: int, elem: int) -> str:
    shape = f"[{num_blocks}, {block_size}, {len(kv_heads)}, {head_dim}]"
    rows = [f'<TR><TD COLSPAN="2"><B>rank {rank}\'s KV cache</B> {shape} per layer<BR/>'
            f'KV heads {", ".join(map(str, kv_heads))} only</TD></TR>']
    if request is not None:
        per_block = 2 * num_layers * block_size * len(kv_heads) * head_dim * elem
        rows.append(f'<TR><TD COLSPAN="2"><I>{html.escape(request["seq_id"])}</I>: '
                    f'{request["num_computed_tokens"]} tokens, {per_block} B of each block here</TD></TR>')
        for i, b in enumerate(request["block_table"]):
            held = min(max(request["num_computed_tokens"] - i * block_size, 0), block_size)
            first = i * block_size
            rows.append(f'<TR><TD>block {b}</TD><TD>tokens {first}–{first + max(held, 1) - 1} '
                        f'({held}/{block_size})</TD></TR>')
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">' + "".join(rows) + "</TABLE>>"


def split_dot(plan: dict, request: dict | None = None, block_size: int = 16, num_blocks: int = 0) -> str:
    """DOT source: one layer split over the ranks of `plan` (`sharding.split_plan`), and `request`'s KV
    (a snapshot's request)."""
    n, layer, head_dim = len(plan["ranks"]), plan["layer"], plan["head_dim"]
    described = [r["weights"] for r in plan["ranks"]]
    hq, hkv = plan["num_heads"], plan["num_kv_heads"]
    elem = plan["element_size"]
    g = Digraph("tp_split")
    g.attr(rankdir="TB", newrank="true", fontname=FONT, fontsize="15", labelloc="t", nodesep="0.35", ranksep="0.3",
           label=f"tensor parallelism over {n} ranks: layer {layer} of {plan['model']} "
                 f"({hq} query heads, {hkv} KV heads, head_dim {head_dim})")
    g.attr("node", fontname=FONT, fontsize="11", shape="box", style="rounded,filled")
    g.attr("edge", arrowsize="0.6")
    names = [w["name"] for w in described[0]]
    for r, weights in enumerate(described):
        with g.subgraph(name=f"cluster_rank{r}") as c:
            c.attr(label=f"rank {r}" + (" (the driver)" if r == 0 else " (a worker process)"), style="rounded",
                   color="#737373", fontname=FONT)
            fill = RANK_FILL[r % len(RANK_FILL)]
            for w in weights:
                c.node(f"r{r}_{w['name']}", _label(w, head_dim), fillcolor=fill)
            q_heads = range(r * hq // n, (r + 1) * hq // n)
            c.node(f"r{r}_attn", f"attention over query heads {_runs(((q_heads.start, q_heads.stop),))}\n"
                                 f"(reads K/V through the block table)", fillcolor="white")
            c.node(f"r{r}_kv", _kv_table(r, plan["ranks"][r]["kv_heads"], request, block_size, num_blocks,
                                         head_dim, plan["num_layers"], elem), shape="plaintext", style="")
            c.edge(f"r{r}_kv", f"r{r}_attn", style="dashed", arrowhead="none")
    # The order a hidden state meets them, in groups (a group's members run side by side); a
    # collective joins every rank's column.
    attn_in = [x for x in names if x in ("qkv", "q_proj", "k_proj", "v_proj")]
    mlp_in = [x for x in names if x in ("fc", "gate_proj", "up_proj")]
    attn_out = next(x for x in names if x in ("out", "o_proj"))
    mlp_out = next(x for x in names if x in ("proj", "down_proj"))
    groups = [[names[0]], ["ar0"], attn_in, ["attn"], [attn_out], ["ar1"], mlp_in, [mlp_out], ["ar2"],
              [names[-1]], ["gather"]]
    collectives = {"ar0": "all-reduce (sum)\nthe embedding rows", "ar1": "all-reduce (sum)\npartial outputs",
                   "ar2": "all-reduce (sum)\npartial outputs", "gather": "gather to rank 0\nlogits [S, vocab]"}
    for key, text in collectives.items():
        g.node(key, text, shape="ellipse", fillcolor=COLLECTIVE)
    for r in range(n):
        node = lambda item: item if item in collectives else f"r{r}_{item}"   # noqa: E731
        for here, there in zip(groups, groups[1:]):
            for a in here:
                for b in there:
                    g.edge(node(a), node(b))
    return g.source
