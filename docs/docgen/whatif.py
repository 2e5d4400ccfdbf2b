"""whatif.md: rewind, branch and compare in the REPL, `nanoserve compare`, and two plots of a comparison.

The REPL session and the command come from the page itself and run as shown;
the plots are `nanoserve.whatif.plots` figures of the same comparison the
command prints (memory-pressure, recompute vs swap), drawn as SVG with fixed
ids and no date, so a fresh run gives the same bytes. The facts the prose
states (where the runs diverge, what was preempted) come from those runs, and
the job asserts what the prose takes for granted.
"""

from __future__ import annotations

from docgen import Result, regions, session
from docgen.cli import run_console

PAGE = "whatif.md"


def make(read) -> Result:
    from nanoserve import events as ev
    from nanoserve.whatif.compare import compare
    from nanoserve.whatif.plots import render
    from nanoserve.whatif.workload import scenario_pair

    out = Result()
    held = regions.regions(read(PAGE))
    ns: dict = {}
    out.region(PAGE, "whatif.session", session.session_region(held["whatif.session"], ns))
    run, swap, c = ns["run"], ns["swap"], ns["c"]
    preempted = next(e for e in run.events if isinstance(e, ev.Preempted))
    assert c.first_divergence == preempted.step, "the prose says the runs part at the first preemption"
    assert c.difference("swaps") > 0 and c.a.totals()["swaps"] == 0
    tokens = [[(e.seq_id, e.token_id) for e in r.events if isinstance(e, ev.TokenSampled)] for r in (run, swap)]
    assert sorted(tokens[0]) == sorted(tokens[1]), "the prose says the greedy tokens are the same either way"
    out.facts(PAGE, "whatif", {"first": c.first_divergence, "victim": preempted.seq_id})

    out.region(PAGE, "whatif.cli", run_console(held["whatif.cli"]))
    a, b = scenario_pair("memory-pressure", {"preemption_mode": "swap"})
    pair = compare(a, b, labels=("recompute", "swap"))
    assert pair.a.totals()["prefix hit tokens"] > pair.b.totals()["prefix hit tokens"], "recompute reuses more"
    out.facts(PAGE, "whatif.mp", {"first": pair.first_divergence,
                                  "hits": pair.a.totals()["prefix hit tokens"] - pair.b.totals()["prefix hit tokens"]})
    for what in ("blocks", "timeline"):
        out.files[f"docs/img/whatif-{what}.svg"] = render(pair, what, "svg")
    return out
