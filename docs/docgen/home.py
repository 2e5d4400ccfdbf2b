"""The home page and Getting started's `implementation` session: on tiny-llama, run as the pages show them.

(The home page's example prints no generated text, so a random model serves; Getting started's
REPL sessions, which do, run SmolLM2 in the slow `repl` job, docgen/repl.py.)

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


def paths(read, out: Result) -> None:
    """Getting started's `implementation` session: which code runs (tiny-llama: no text is shown)."""
    out.region("getting-started.md", "gs.paths", session.session_region(regions.regions(read("getting-started.md"))["gs.paths"], {}))


def make(read) -> Result:
    out = Result()
    home(read, out)
    paths(read, out)
    return out
