"""The TUI tour and the classroom guide: facts from the scenarios' recorded traces.

Each scenario's trace is the one recorded on SmolLM2 (docs/traces/, see
`traces.py`: its chat workload, the prompts and answers a learner reads), and
each page states what its picture shows from that trace: the step the
screenshot was taken at (the same `showcase_step` the screenshots use), the
memory-pressure screen's blocks, tables, eviction and preemption, and the
steps a teacher should stop at. The memory-pressure Graphviz pictures are
drawn here too, at the same step, with the exporter `nanoserve export` uses.
"""

from __future__ import annotations

from pathlib import Path

from docgen import Result, regions, sizes
from docgen.home import _ranges
from docgen.pictures import graphviz_svg
from docgen.traces import path as shipped
from nanoserve import events as ev
from nanoserve.scenarios import SCENARIOS
from nanoserve.trace import read_trace
from nanoserve.viz.graphviz import pool_dot, state_at, tables_dot
from nanoserve_tui.screenshots import showcase_step

TUI, CLASS = "tui.md", "classroom.md"


def of(events, kind, step=None, rid=None):
    return [e for e in events if isinstance(e, kind) and (step is None or e.step == step)
            and (rid is None or getattr(e, "seq_id", None) == rid)]


def words(items) -> str:
    items = [str(i) for i in items]
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1] if items else "none"


def memory_pressure(events, trace: Path, out: Result) -> None:
    step = showcase_step("memory-pressure", events)
    state = state_at(trace, step)
    bs = state.block_size
    preempted = of(events, ev.Preempted, step)
    assert len(preempted) == 1 and preempted[0].mode == "recompute", "the prose tells one recompute preemption"
    victim = preempted[0].seq_id
    assert not of(events, ev.RadixEvicted, step), "the prose says the cache had nothing left to evict"
    freed = of(events, ev.BlocksFreed, step, victim)[0]
    got = next(e for e in of(events, ev.BlocksAllocated, step) if set(e.block_ids) & set(freed.released))
    before = state_at(trace, step - 1)
    assert victim == before.running[-1], "the prose says the victim is the newest running request"
    assert not before.free_queue and not state.free_queue, "the prose says the free queue was empty, and is again"
    assert victim not in {e.seq_id for e in of(events, ev.ChunkScheduled, step)}, "not in the batch"
    owners, kinds = state.block_owners(), state.block_kinds()
    kept = [b for b in freed.block_ids if b not in freed.released]
    assert kept and all(owners.get(b) or kinds[b] == "cached" for b in kept), \
        "the prose says the victim's other blocks stayed, shared or cached"
    cached_only = [b for b, k in enumerate(kinds) if k == "cached"]
    r0 = state.sequences["r0"]
    last = r0.block_table[-1]
    index = len(r0.block_table) - 1
    fill = r0.num_computed_tokens - index * bs
    table = " ".join(f"{i}→{b}" for i, b in enumerate(r0.block_table)) + f" ({fill}/{bs})"
    shared = sorted({b for b, who in owners.items() if len(who) > 1})
    out.facts(TUI, "mp", {
        "block": last, "logical": index, "tokens": f"{index * bs}–{index * bs + fill - 1}",
        "fill": f"{fill}/{bs}", "r0_table": f"`{table}`", "shared": words(shared),
        "got": f"`{got.seq_id}`", "victim": f"`{victim}`", "lost": preempted[0].num_tokens_lost,
        "victim_blocks": len(freed.block_ids), "released": words(freed.released),
        "released_list": f"`to the free queue [{' '.join(map(str, freed.released))}]`",
        "victim_shared": words(kept), "cached": words(cached_only),
        "waiting": words(f"`{r}`" for r in state.waiting),
    })
    out.region(TUI, "mp.caption", f"Memory pressure, step {step}: a {state.num_blocks}-block pool shared by "
                                  f"{len(state.sequences)} requests.")
    # the same step as Graphviz pictures, for slides
    for what, build in (("tables", tables_dot), ("pool", pool_dot)):
        out.files[f"docs/img/memory-pressure-{what}.svg"] = graphviz_svg(build(state))
    out.region(TUI, "mp.export", regions.block(
        "nanoserve record --scenario memory-pressure -o pressure.jsonl\n"
        f"nanoserve export --trace pressure.jsonl --step {step} --what tables --format svg\n"
        f"nanoserve export --trace pressure.jsonl --step {step} --what pool --format png", "bash"))

    steps = [e.step for e in of(events, ev.Preempted)]
    victims = [e.seq_id for e in of(events, ev.Preempted)]
    out.facts(CLASS, "mp", {"steps": words(steps), "victims": words(f"`{v}`" for v in dict.fromkeys(victims))})


def continuous_batching(events, out: Result) -> None:
    step = showcase_step("continuous-batching", events)
    first = of(events, ev.SequenceFinished)[0]
    freed = of(events, ev.BlocksFreed, first.step, first.seq_id)[0]
    kept = [b for b in freed.block_ids if b not in freed.released]
    admitted = of(events, ev.SequenceAdmitted, step)[0].seq_id
    arrived = of(events, ev.RequestAdded, rid=admitted)[0].step
    seats = SCENARIOS["continuous-batching"].chat.config["max_num_seqs"]
    assert kept, "the prose says the finished request's full blocks stay cached"
    assert arrived < first.step, "the prose says the admitted request had been waiting for a seat"
    facts = {"finished": f"`{first.seq_id}`", "finish_step": first.step, "kept": words(kept),
             "released": words(freed.released), "admitted": f"`{admitted}`", "step": step,
             "arrived": arrived, "seats": seats}
    out.facts(CLASS, "cb", {k: facts[k] for k in ("finished", "finish_step", "kept", "released", "admitted",
                                                   "step")})
    out.facts(TUI, "cb", {k: facts[k] for k in ("finished", "finish_step", "admitted", "step", "arrived",
                                                 "seats")})


def long_prompt(events, out: Result) -> None:
    step = showcase_step("long-prompt", events)
    added = of(events, ev.RequestAdded, rid="long")[0]
    chunks = [e for e in of(events, ev.ChunkScheduled, rid="long") if e.is_prefill]
    budget = SCENARIOS["long-prompt"].chat.config["max_num_batched_tokens"]
    out.facts(TUI, "lp", {"step": step, "tokens": added.num_prompt_tokens, "budget": budget,
                          "chunks": len(chunks), "first": chunks[0].step, "last": chunks[-1].step})
    out.facts(CLASS, "lp", {"first": chunks[0].step, "last": chunks[-1].step})


def shared_prompt(events, out: Result) -> None:
    step = showcase_step("shared-system-prompt", events)
    hits = [e for e in of(events, ev.PrefixMatched) if e.num_hit_tokens]
    assert len({e.num_hit_tokens for e in hits}) == 1, "the prose gives one hit size for every later request"
    out.facts(TUI, "sp", {"step": step, "system": shared_start(events), "hit": hits[0].num_hit_tokens,
                          "hits": len(hits)})


def shared_start(events) -> int:
    """The characters of the system turn every shared-system-prompt request starts with (chat template)."""
    prompts = [e.prompt for e in of(events, ev.RequestAdded)]
    end = "<|im_end|>"
    system = prompts[0][:prompts[0].index(end) + len(end)]
    assert all(p.startswith(system) for p in prompts), "the prose says every request starts with one system turn"
    return len(system)


def parallel(events, out: Result) -> None:
    step = showcase_step("parallel-sampling", events)
    forks = [e for e in of(events, ev.Forked) if e.parent_id == "sample"]
    out.facts(TUI, "ps", {"step": step, "forks": len(forks), "n": len(forks) + 1})


def swap(events, out: Result) -> None:
    step = showcase_step("swap-preemption", events)
    first = of(events, ev.SwappedOut, step)[0]
    back = next(e for e in of(events, ev.SwappedIn, rid=first.seq_id) if e.step > step)
    out.facts(TUI, "sw", {"step": step, "victim": f"`{first.seq_id}`", "blocks": len(first.block_ids),
                          "cpu": _ranges(list(first.cpu_block_ids)), "back": back.step})
    out.facts(CLASS, "sw", {"out": step, "back": back.step, "victim": f"`{first.seq_id}`"})


def speculative(events, out: Result) -> None:
    step = showcase_step("speculative-decoding", events)
    verified = of(events, ev.DraftVerified)
    drafted, accepted = sum(e.num_drafted for e in verified), sum(e.num_accepted for e in verified)
    out.facts(TUI, "sd", {"step": step, "accepted": accepted, "drafted": drafted})


def make(read) -> Result:
    out = Result()
    traces = {name: shipped(name) for name in SCENARIOS}
    ev_of = {name: read_trace(path) for name, path in traces.items()}
    memory_pressure(ev_of["memory-pressure"], traces["memory-pressure"], out)
    continuous_batching(ev_of["continuous-batching"], out)
    long_prompt(ev_of["long-prompt"], out)
    shared_prompt(ev_of["shared-system-prompt"], out)
    parallel(ev_of["parallel-sampling"], out)
    swap(ev_of["swap-preemption"], out)
    speculative(ev_of["speculative-decoding"], out)
    out.facts(TUI, "tui", {"num_scenarios": sizes.number(len(SCENARIOS))})
    return out
