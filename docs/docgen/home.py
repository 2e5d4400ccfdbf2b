"""The home page and Getting started: REPL sessions on tiny-llama, run as the page shows them.

The code comes from the pages' own ```python / ```pycon blocks; this job runs
it, rewrites the output, and derives the facts the prose around it states
(which blocks a request holds, what its last step released) from the same
engine.
"""

from __future__ import annotations

from docgen import Result, regions, session, sizes


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0–2 and 5' (a block table in words)."""
    parts, start = [], None
    for i, b in enumerate(ids):
        if start is None:
            start = b
        if i + 1 == len(ids) or ids[i + 1] != b + 1:
            parts.append(str(start) if start == b else f"{start}–{b}")
            start = None
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _request(engine, rid: str) -> dict:
    return next(r for r in engine.snapshot()["sequences"] if r["seq_id"] == rid)


def home(read, out: Result) -> None:
    page = "index.md"
    body = regions.regions(read(page))["home.example"]
    ns: dict = {}
    out.region(page, "home.example", session.script_region(body, ns))
    engine = ns["engine"]
    r1, r2 = _request(engine, "r1"), _request(engine, "r2")
    bs = engine.config.block_size
    assert r1["num_computed_tokens"] % bs == 0 and r2["num_computed_tokens"] < bs, \
        "the prose says r1's prompt fills whole blocks and r2's fits in part of one"
    out.facts(page, "home", {
        "r1_tokens": r1["num_computed_tokens"], "r1_blocks": len(r1["block_table"]),
        "r1_table": _ranges(r1["block_table"]), "r2_tokens": r2["num_computed_tokens"],
        "r2_block": r2["block_table"][0], "block_size": bs,
    })
    # counts read from the repository (docgen/sizes.py), not prose that goes stale
    out.facts(page, "home", {"num_lessons": sizes.number(len(sizes.lessons()))})


def getting_started(read, out: Result) -> None:
    page = "getting-started.md"
    bodies = regions.regions(read(page))
    ns: dict = {}
    for name in ("gs.first", "gs.step"):
        out.region(page, name, session.session_region(bodies[name], ns))
    engine = ns["engine"]
    r1 = _request(engine, "r1")
    assert r1["num_output_tokens"] == 1 and r1["num_computed_tokens"] == r1["num_prompt_tokens"]
    cached = sorted(b for n in engine.snapshot()["radix"]["nodes"] for b in n["block_ids"])
    assert cached == r1["block_table"], "the prose says the cache holds exactly r1's prompt blocks"
    out.facts(page, "gs.after1", {
        "r1_prompt": r1["num_prompt_tokens"], "r1_table": _ranges(r1["block_table"]),
        "r1_blocks": len(r1["block_table"]),
    })

    out.region(page, "gs.loop", session.session_region(bodies["gs.loop"], ns))
    freed = [e for e in ns["result"].events if type(e).__name__ == "BlocksFreed"]
    assert len(freed) == 1 and freed[0].seq_id == "r1", "the prose reads the last step's one BlocksFreed"
    kept = [b for b in freed[0].block_ids if b not in freed[0].released]
    radix = engine.snapshot()["radix"]["nodes"]
    tree_blocks = {b for n in radix for b in n["block_ids"]}
    assert set(kept) <= tree_blocks, "the blocks that stayed are the tree's"
    assert all(n["lock_count"] == 0 for n in radix), "nothing runs: every cached block is evictable"
    out.facts(page, "gs.last", {
        "table": f"`{freed[0].block_ids}`", "released": f"`{freed[0].released}`",
        "kept": _ranges(sorted(kept)), "num_cached": len(tree_blocks),
        "step": freed[0].step,
    })

    ns2: dict = {}
    out.region(page, "gs.llm", session.session_region(bodies["gs.llm"], ns2))
    out.region(page, "gs.paths", session.session_region(bodies["gs.paths"], {}))


def make(read) -> Result:
    out = Result()
    home(read, out)
    getting_started(read, out)
    return out
