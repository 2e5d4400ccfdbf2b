"""The step page: lesson 1's first two workloads, rerun, give the slot table and two steps of events."""

from __future__ import annotations

from docgen import Result, regions
from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev

PAGE = "concepts/step.md"
BS = 4
CONFIG = dict(model="tiny-llama", block_size=BS, num_blocks=16, max_num_batched_tokens=32,
              enable_prefix_caching=False)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def table_of(engine: LLMEngine, rid: str) -> dict:
    return next(r for r in engine.snapshot()["sequences"] if r["seq_id"] == rid)


def slots(out: Result) -> None:
    """Lesson 1, section 1: A and B decode side by side for 5 steps; A's table and slots."""
    engine = LLMEngine(EngineConfig(**CONFIG))
    engine.add_request("A", "Hello", greedy(8))
    engine.add_request("B", "World!", greedy(8))
    for _ in range(5):
        engine.step()
    a, b = table_of(engine, "A"), table_of(engine, "B")
    table, n = a["block_table"], a["num_computed_tokens"]
    between = [x for x in range(table[0], table[-1]) if x not in table]
    assert between and all(x in b["block_table"] for x in between), "the prose says B took the blocks in between"
    cols = range(n)
    row = lambda label, f: f"{label:10s}" + " ".join(f"{f(i):>2}" for i in cols)   # noqa: E731
    text = "\n".join([row("token i", lambda i: i), row("block", lambda i: table[i // BS]),
                      row("slot", lambda i: table[i // BS] * BS + i % BS)])
    out.region(PAGE, "step.slots", regions.block(text))
    out.facts(PAGE, "step", {"table_a": f"`{table}`", "between": ", ".join(map(str, between)), "n_a": n})


def two_steps(out: Result) -> None:
    """Lesson 1, section 2: max_num_seqs=2, L, S and W; the two steps around S's finish."""
    engine = LLMEngine(EngineConfig(**CONFIG, max_num_seqs=2))
    engine.add_request("L", "Long", greedy(10))
    engine.add_request("S", "Short", greedy(2))
    engine.add_request("W", "Wait", greedy(3))
    events = []
    while engine.has_unfinished_requests():
        events += engine.step().events
    finish = next(e.step for e in events if isinstance(e, ev.SequenceFinished) and e.seq_id == "S")
    admit = next(e.step for e in events if isinstance(e, ev.SequenceAdmitted) and e.seq_id == "W")
    assert admit == finish + 1, "the prose says W takes S's seat in the very next step"
    shown = [e for e in events if e.step in (finish, admit) and not isinstance(e, ev.RequestAdded)]
    out.region(PAGE, "step.events", regions.block("\n".join(_short(e) for e in shown)))
    freed = next(e for e in shown if isinstance(e, ev.BlocksFreed) and e.seq_id == "S")
    grew = [e for e in shown if isinstance(e, ev.BlocksAllocated) and e.seq_id == "L"]
    assert freed.released == tuple(reversed(freed.block_ids)), "the prose says: released last block first"
    assert grew, "the prose explains L's new block"
    out.facts(PAGE, "step.ev", {
        "finish": finish, "admit": admit, "s_blocks": f"`{freed.block_ids}`", "s_released": f"`{freed.released}`",
        "l_block": grew[0].block_ids[0], "l_step": grew[0].step,
    })


def _short(e) -> str:
    """An event as its repr, with the long float fields rounded so a line fits 100 columns."""
    text = repr(e)
    if isinstance(e, ev.StepFinished):
        text = text.replace(f"duration_s={e.duration_s!r}", f"duration_s={e.duration_s:.4f}")
    if isinstance(e, ev.TokenSampled):
        text = text.replace(f"logprob={e.logprob!r}", f"logprob={e.logprob:.3f}")
    if len(text) > 100:      # break at the last field that fits, continuation under the first field
        cut = text.rindex(", ", 0, 100) + 1
        text = text[:cut] + "\n" + " " * (text.index("(") + 1) + text[cut + 1:]
    return text


def make(read) -> Result:
    out = Result()
    slots(out)
    two_steps(out)
    return out
