"""concepts/structured-output.md: the structured-output scenario's grammar plot and the facts the page states.

The scenario is recorded on tiny-llama (random weights, so the grammar does
all the shaping); the picture is `nanoserve plot --what grammar` of that
trace (SVG with fixed ids and no date: a fresh run gives the same bytes), and
the numbers in the prose (tokens forced, top choices masked, the texts) come
from its events.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from docgen import Result

PAGE = "concepts/structured-output.md"


def make(read) -> Result:
    from nanoserve import events as ev
    from nanoserve.scenarios import record
    from nanoserve.trace import fold_all, read_trace
    from nanoserve.whatif.plots import render

    out = Result()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "structured-output.jsonl"
        record("structured-output", trace)
        events = read_trace(trace)
    state = fold_all(events)
    out.files["docs/img/structured-output-grammar.svg"] = render(events, "grammar", "svg")
    views = state.sequences
    person = json.loads(views["json"].output_text)
    assert set(person) == {"name", "born", "city"} and 1000 <= person["born"] <= 2100, "the prose: it parses"
    assert views["choice"].output_text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", views["date"].output_text)
    assert views["free"].grammar is None and views["free"].finish_reason == "length"
    g = views["json"].grammar
    constrained = [e for e in events if isinstance(e, ev.TokenConstrained) and e.seq_id == "json"]
    out.facts(PAGE, "so", {
        "json_tokens": g.num_tokens, "json_forced": g.num_forced, "json_masked": g.num_top_masked,
        "date": f"`{views['date'].output_text}`", "choice": f"`{views['choice'].output_text}`",
        "max_allowed": max(e.num_allowed for e in constrained), "vocab": g.vocab_size,
    })
    return out
