"""Pictures of the memory mechanisms, and the facts their pages state, from lessons 4-6's workloads.

Each picture is the Graphviz exporter (`nanoserve.viz.graphviz`) drawing the
view state of a real run at the step the page talks about. The runs are the
lessons' workloads on `tiny-llama`, so the block ids are the ones the lessons
print. The view state is folded from the engine's events as they happen
(`engine.subscribe`), exactly as the TUI and a recorded trace see it, so a
step's hits, new tree nodes and touched blocks are marked. The captions'
numbers (block ids, ref counts, tokens computed) come from the same runs.
"""

from __future__ import annotations

from docgen import Result
from docgen.home import _ranges
from docgen.pictures import graphviz_svg
from docgen.scenarios import words
from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev
from nanoserve.trace import fold
from nanoserve.viz.graphviz import pool_dot, radix_dot, tables_dot

BUILDERS = {"tables": tables_dot, "pool": pool_dot, "radix": radix_dot}
PREFIX, FORK, PREEMPT = "concepts/prefix-cache.md", "concepts/fork.md", "concepts/preemption.md"


class Camera:
    """Folds an engine's events into a view state; after step s keeps the states `steps` asks for."""

    def __init__(self, engine: LLMEngine | None, steps: set[int]) -> None:
        self.state, self.steps, self.states, self.events = None, steps, {}, []
        if engine is not None:
            engine.subscribe(self.on_event)

    @classmethod
    def replay(cls, events, steps: set[int]) -> Camera:
        """The same camera, fed a recorded run's events (a shipped trace) instead of a live engine's."""
        camera = cls(None, steps)
        for event in events:
            camera.on_event(event)
        return camera

    def on_event(self, event) -> None:
        self.state = fold(self.state, event)
        self.events.append(event)
        if isinstance(event, ev.StepFinished) and event.step in self.steps:
            self.states[event.step] = _copy(self.state)

    def at(self, step: int):
        assert step in self.states, f"the run ended before step {step}"
        return self.states[step]


def _copy(state):
    import copy
    return copy.deepcopy(state)


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple[str, object, SamplingParams]]]) -> None:
    """Add each request before its step (arrivals[step]), then step to the end."""
    while any(s > engine.step_count for s in arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(engine.step_count + 1, []):
            engine.add_request(rid, prompt, params)
        engine.step()


def picture(out: Result, name: str, what: str, state) -> None:
    out.files[f"docs/img/{name}.svg"] = graphviz_svg(BUILDERS[what](state))


def prefill_tokens(events) -> int:
    return sum(e.num_tokens for e in events if isinstance(e, ev.ChunkScheduled) and e.is_prefill)


# -- lesson 4: the prefix cache ---------------------------------------------------------------
# Lesson 4's workload, recorded once on SmolLM2 (the reading path) by the `traces` job into
# docs/traces/lesson4-prefix-cache{,-off}.jsonl, so the radix tree shows readable questions and answers;
# this job replays those traces (no model, and the same on every CPU).
SYSTEM = "You are a helpful assistant. Answer briefly and politely. "
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to 3.", "Pick a fruit."]
PC_BLOCK = 4        # SmolLM2 spends few tokens on SYSTEM (11 are shared): blocks of 4 give it a node of its own
PREFIX_TRACES = {True: "lesson4-prefix-cache", False: "lesson4-prefix-cache-off"}


def record_prefix_cache(loaded) -> dict[str, list]:
    """Lesson 4's run with the cache on and off, on SmolLM2's reading path: trace name -> its events."""
    from docgen import traces

    runs = {}
    for caching, name in PREFIX_TRACES.items():
        engine = LLMEngine(EngineConfig(model=traces.MODEL, block_size=PC_BLOCK, num_blocks=96, max_num_batched_tokens=128,
                                        enable_prefix_caching=caching, **traces.READING_PATH), loaded=loaded)
        events: list = []
        engine.subscribe(events.append)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        drive(engine, {i + 1: [(f"q{i}", SYSTEM + q, params)] for i, q in enumerate(QUESTIONS)})
        runs[name] = traces.timeless(events)
    return runs


def prefix_cache(out: Result) -> None:
    """Lesson 4: one system prompt, a question per step; step 5 has all five running."""
    from docgen import traces
    from nanoserve.trace import read_trace

    runs = {caching: Camera.replay(read_trace(traces.path(name)), {5}) for caching, name in PREFIX_TRACES.items()}
    camera = runs[True]
    at5, end = camera.at(5), camera.state          # after step 5, and after the last step
    picture(out, "radix-shared-system-prompt", "radix", at5)
    picture(out, "pool-shared-system-prompt", "pool", at5)
    picture(out, "radix-after-requests", "radix", end)

    locks = at5.lock_counts()
    system_node = next(n for n in at5.radix_nodes() if n.parent_id == 0)
    children = [n for n in at5.radix_nodes() if n.parent_id == system_node.node_id]
    shared = sorted(b for b, who in at5.block_owners().items() if len(who) > 1)
    assert shared == sorted(system_node.block_ids), "the caption says the shared blocks are the system node's"
    assert len(children) == len(QUESTIONS), "the caption says each question has its own node"
    assert not any(end.lock_counts().values()), "the caption says every node is unlocked"
    hits = [e.num_hit_tokens for e in camera.events if isinstance(e, ev.PrefixMatched)]
    out.facts(PREFIX, "pc", {
        "system_blocks": len(system_node.block_ids), "system_lock": locks[system_node.node_id],
        "n": len(QUESTIONS), "shared": _ranges(shared), "ref": at5.ref_counts[shared[0]],
        "end_step": end.step, "block_size": PC_BLOCK,
        "hit": hits[1], "prefill_on": prefill_tokens(camera.events),
        "prefill_off": prefill_tokens(runs[False].events),
    })


# -- lesson 5: fork and beam search ------------------------------------------------------------
PROMPT = "Once upon a time, in a land far"


def fork(out: Result) -> None:
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64, enable_prefix_caching=False))
    camera = Camera(engine, {2})
    drive(engine, {1: [("p", PROMPT, SamplingParams(n=4, max_tokens=8, temperature=0, ignore_eos=True))]})
    state = camera.at(2)
    picture(out, "tables-n4-fork", "tables", state)
    tables = [state.sequences[r].block_table for r in state.running]
    full = len(PROMPT) // 4
    shared = tables[0][:full]
    assert all(t[:full] == shared for t in tables) and all(state.ref_counts[b] == len(tables) for b in shared)
    lasts = [t[full] for t in tables]
    cows = [e for e in camera.events if isinstance(e, ev.CowCopied) and e.step == 2]
    assert len(set(lasts)) == len(tables) and len(cows) == len(tables) - 1, "each has its own copy of the last block"
    kept = (set(lasts) - {e.dst for e in cows}).pop()
    out.facts(FORK, "n4", {"full": full, "n": len(tables), "kept": kept, "copies": len(cows)})

    beams = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64, enable_prefix_caching=False))
    beam_camera = Camera(beams, {4})
    drive(beams, {1: [("b", PROMPT, SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=6, min_tokens=6))]})
    state = beam_camera.at(4)
    picture(out, "tables-beam-search", "tables", state)
    tables = {r: state.sequences[r].block_table for r in state.running}
    common = [b for b in next(iter(tables.values())) if all(b in t for t in tables.values())]
    copied = [e for e in beam_camera.events if isinstance(e, ev.CowCopied) and e.step == 4]
    assert common[:full] == list(range(full)), "the caption says all beams share the prompt's blocks"
    extra = common[full:]
    out.facts(FORK, "beam", {"extra": words(extra) if extra else "none", "copied": len(copied),
                             "beams": len(tables)})


# -- lesson 6: preemption ----------------------------------------------------------------------
TEXT = "The quick brown fox jumps over the lazy dog. "


def preemption(out: Result) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for name, config in (("baseline", dict(num_blocks=200)), ("recompute", {}),
                         ("swap", dict(preemption_mode="swap")), ("cached", dict(enable_prefix_caching=True))):
        engine = LLMEngine(EngineConfig(**{**dict(model="tiny-llama", block_size=4, num_blocks=20,
                                                  max_num_batched_tokens=32, enable_prefix_caching=False),
                                           **config}))
        runs[name] = Camera(engine, {5})
        drive(engine, {1: [(f"r{i}", TEXT[: 10 + 4 * i], params) for i in range(5)]})
    swap, recompute = runs["swap"].at(5), runs["recompute"].at(5)
    picture(out, "pool-swap", "pool", swap)
    picture(out, "tables-swap", "tables", swap)
    picture(out, "tables-recompute", "tables", recompute)

    def computed(cam) -> int:
        return sum(e.num_tokens for e in cam.events if isinstance(e, ev.ChunkScheduled))

    def of(cam, kind, step=None):
        return [e for e in cam.events if isinstance(e, kind) and (step is None or e.step == step)]

    out5 = of(runs["swap"], ev.SwappedOut, 5)
    assert len(out5) == 1, "the captions tell one swap-out in step 5"
    victim = out5[0].seq_id
    took = [e for e in of(runs["swap"], ev.BlocksAllocated, 5) if set(e.block_ids) & set(out5[0].block_ids)]
    never = [r for r, req in swap.sequences.items() if r in swap.waiting and not req.block_table
             and not any(e.seq_id == r and e.step <= 5 for e in of(runs["swap"], ev.SequenceAdmitted))]
    assert [e.seq_id for e in of(runs["recompute"], ev.Preempted, 5)] == [victim], "same victim in both runs"
    lost = sum(e.num_tokens_lost for e in of(runs["recompute"], ev.Preempted))
    moved = sum(len(e.block_ids) for e in of(runs["swap"], ev.SwappedOut))
    moved_in = sum(len(e.block_ids) for e in of(runs["swap"], ev.SwappedIn))
    base = computed(runs["baseline"])
    assert computed(runs["recompute"]) == base + lost and computed(runs["swap"]) == base
    cached = runs["cached"]
    victims = {e.seq_id for e in of(cached, ev.Preempted)}
    matches = of(cached, ev.PrefixMatched)
    comeback = sum(e.num_hit_tokens for e in matches if e.seq_id in victims
                   and any(m.seq_id == e.seq_id and m.step < e.step for m in matches))
    cache_lost = sum(e.num_tokens_lost for e in of(cached, ev.Preempted))
    out.facts(PREEMPT, "pr", {
        "victim": f"`{victim}`", "blocks": len(out5[0].block_ids), "cpu": _ranges(list(out5[0].cpu_block_ids)),
        "took": (f"`{took[0].seq_id}` took block {words(took[0].block_ids)}" if took else "nobody took them yet"),
        "waiting": (f"{words(f'`{r}`' for r in never)} still {'waits' if len(never) == 1 else 'wait'} for a first "
                    "admission" if never else "every other request has been admitted"),
        "base": base, "recompute": computed(runs["recompute"]), "lost": lost, "out": moved, "in": moved_in,
        "cache_lost": cache_lost, "cache_found": comeback, "cache_extra": cache_lost - comeback,
    })


def make(read) -> Result:
    out = Result()
    prefix_cache(out)
    fork(out)
    preemption(out)
    return out
