"""Lab scheduler-budget: the token budget, decodes first, chunked prefill (nanoserve/scheduler.py).

The student writes `Scheduler._chunk_size` (how much of a prompt fits: cut to
the budget with chunked prefill, or wait for a step with room without it)
and `_schedule_running` (passes 1 and 2 of a step: running sequences,
decodes before prefill chunks, within the budget). Admission, preemption
and the block work stay the engine's. The first checks call each function
directly, on sequences, a pool and a KV manager of the engine's (in the
checker) that the check sets up; then every step of the real engine is
watched: its token count, which requests it left out, its chunks.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.events import ChunkScheduled, StepClock
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, run_engine, same_as_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect

BUDGET = 8


class Setup:
    """The engine's config, pool, KV manager and sequences (here); the student's scheduler (in the worker)."""

    def __init__(self, ctx: Context, chunked: bool = True, num_blocks: int = 32, **config) -> None:
        from nanoserve.config import EngineConfig
        from nanoserve.kv_manager import KVManager
        self.config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=num_blocks,
                                   max_num_batched_tokens=BUDGET, enable_chunked_prefill=chunked, **config)
        self.pool = BlockPool(num_blocks, 4)
        self.events: list = []
        self.clock = StepClock()
        self.kv = KVManager(self.pool, None, None, self.events.append, clock=self.clock)
        self.sched = ctx.module.Scheduler(self.config, self.kv, self.events.append, clock=self.clock)

    def seq(self, seq_id: str, prompt: int, output: int = 0, computed: int = 0, running: bool = True):
        """A sequence with `prompt` prompt and `output` generated tokens, `computed` of them with KV (and blocks)."""
        from nanoserve.sampling_params import SamplingParams
        from nanoserve.sequence import Sequence, SequenceStatus
        seq = Sequence(seq_id, None, list(range(10, 10 + prompt)), SamplingParams(max_tokens=20),
                       status=SequenceStatus.RUNNING if running else SequenceStatus.WAITING,
                       output_token_ids=list(range(50, 50 + output)))
        seq.block_table = self.pool.allocate(self.pool.blocks_needed(0, computed)) if running else []
        seq.num_computed_tokens = computed
        if running:
            self.sched.running.append(seq)
        return seq

    def planning(self, budget: int, drafts: dict | None = None):
        from nanoserve.scheduler import Planning, StepPlan
        return Planning(StepPlan(), budget, drafts or {})


def _chunks_of(planning) -> list[tuple]:
    return [(c.seq.seq_id, c.num_tokens, c.is_prefill, list(c.draft_token_ids)) for c in planning.plan.chunks]


CHUNK_HINT = ('_chunk_size: which tokens of this sequence still need their KV computed this step? KV already '
              'computed and a prefix the cache supplies both count as done, and the two can overlap (counting '
              'both would count some tokens twice). When what is left is more than the budget, what does '
              'enable_chunked_prefill allow: a part now, or waiting for a step with room?')


def chunk_size(ctx: Context) -> None:
    for chunked in (True, False):
        s = Setup(ctx, chunked=chunked)
        for args, want, what in (((s.seq("a", 10, running=False), 16), 10, "a 10-token prompt, budget 16"),
                                 ((s.seq("b", 10, running=False), 10), 10, "a 10-token prompt, budget 10"),
                                 ((s.seq("c", 10, running=False), 8), 8 if chunked else 0,
                                  "a 10-token prompt, budget 8"),
                                 ((s.seq("d", 10, running=False), 16, 8), 2, "10 tokens, 8 of them cached"),
                                 ((s.seq("e", 10, output=1, computed=10), 16), 1, "a decode"),
                                 ((s.seq("f", 12, computed=8), 16, 4), 4, "12 tokens, 8 computed, 4 cached"),
                                 ((s.seq("g", 12, computed=4), 16, 8), 4, "12 tokens, 4 computed, 8 cached"),
                                 ((s.seq("h", 21, computed=8), 8), 8 if chunked else 0,
                                  "21 tokens, 8 computed, budget 8")):
            got = s.sched._chunk_size(*args)
            expect(got == want, f"_chunk_size({what}) with enable_chunked_prefill={chunked} returned {got}, "
                   f"expected {want}", CHUNK_HINT)


RUNNING_HINT = ('_schedule_running: compare your plan with the expected one. Which kind of sequence goes first, '
                'so that a long prefill never starves the decodes? For each: how many tokens fit in what is left '
                'of the budget (drafts too, and only those that fit)? What must succeed before a chunk is '
                'planned, and what changes after?')


def schedule_running(ctx: Context) -> None:
    for budget, want in ((8, [("d1", 1, False, []), ("d2", 1, False, []), ("p1", 6, True, [])]),
                         (20, [("d1", 1, False, []), ("d2", 1, False, []), ("p1", 10, True, []),
                               ("p2", 6, True, [])])):
        s = Setup(ctx)
        s.seq("p1", 10)
        s.seq("d1", 10, output=1, computed=10)
        s.seq("p2", 6)
        s.seq("d2", 7, output=2, computed=8)
        planning = s.planning(budget)
        s.sched._schedule_running(planning)
        got = _chunks_of(planning)
        expect(got == want, f"with budget {budget}, running [p1 (prefill 10), d1 (decode), p2 (prefill 6), d2 "
               f"(decode)] got chunks {got} (id, tokens, prefill, drafts); expected {want}", RUNNING_HINT)
        left = budget - sum(c[1] for c in want)
        expect(planning.budget == left, f"with budget {budget} the plan has {planning.budget} left after the chunks "
               f"{[c[:2] for c in got]}, expected {left}", "subtract every chunk's tokens from planning.budget")
        for seq in s.sched.running:
            expect(len(seq.block_table) == s.pool.blocks_needed(0, seq.num_computed_tokens + sum(
                c[1] for c in got if c[0] == seq.seq_id)), f"{seq.seq_id} holds {len(seq.block_table)} blocks "
                "for its scheduled tokens", "get the blocks with self._reserve(seq, num_new, ...) before adding "
                                            "the chunk")

    s = Setup(ctx)
    s.seq("d1", 10, output=1, computed=10)
    s.seq("d2", 10, output=1, computed=10)
    s.seq("p1", 9)
    planning = s.planning(8, {"d1": [5, 6, 7], "p1": [1]})
    s.sched._schedule_running(planning)
    want = [("d1", 4, False, [5, 6, 7]), ("d2", 1, False, []), ("p1", 3, True, [])]
    expect(_chunks_of(planning) == want, f"with drafts d1: [5, 6, 7] and budget 8 got chunks {_chunks_of(planning)}, "
           f"expected {want}", "a decode computes its token plus its drafts (1 + len(drafts)), as far as the budget "
                               "goes; a prefill has no drafts")
    s = Setup(ctx)
    s.seq("d1", 10, output=1, computed=10)
    s.seq("d2", 10, output=1, computed=10)
    planning = s.planning(3, {"d1": [5, 6, 7], "d2": [8]})
    s.sched._schedule_running(planning)
    want = [("d1", 3, False, [5, 6])]
    expect(_chunks_of(planning) == want, f"with drafts d1: [5, 6, 7], d2: [8] and budget 3 got chunks "
           f"{_chunks_of(planning)}, expected {want}", "keep only the drafts that fit in the budget "
                                                   "(draft[:num_new - uncomputed]); nothing is scheduled with no "
                                                   "budget left")

    from nanoserve.sequence import SequenceStatus
    s = Setup(ctx)
    s.seq("d1", 10, output=1, computed=10)
    gone = s.seq("d2", 10, output=1, computed=10)
    gone.status = SequenceStatus.WAITING            # preempted earlier in this pass (still in the list it walks)
    s.seq("beam", 8, output=1, computed=9)          # 0 uncomputed: a beam waiting for its siblings
    s.seq("d3", 10, output=1, computed=10)
    planning = s.planning(8)
    s.sched._schedule_running(planning)
    want = [("d1", 1, False, []), ("d3", 1, False, [])]
    expect(_chunks_of(planning) == want, f"running d1, d2 (no longer RUNNING), beam (nothing to compute), d3 got "
           f"chunks {_chunks_of(planning)}, expected {want}", "skip (continue past) a sequence that is no longer "
           "RUNNING (preempted earlier in this loop) and one with no uncomputed token; the others still run")
    s = Setup(ctx)
    s.seq("d1", 10, output=1, computed=10)
    planning = s.planning(1, {"d1": [5, 6]})
    s.sched._schedule_running(planning)
    expect(_chunks_of(planning) == [("d1", 1, False, [])], f"a decode with drafts [5, 6] and budget 1 got chunks "
           f"{_chunks_of(planning)}, expected [('d1', 1, False, [])]", "the budget left has room for the decode's own "
           "token only: no draft fits (draft[:num_new - uncomputed] is empty)")

    s = Setup(ctx, num_blocks=3)
    s.seq("p1", 8)
    s.seq("p2", 8)
    planning = s.planning(20)
    s.sched._schedule_running(planning)
    expect(_chunks_of(planning) == [("p1", 8, True, [])] and planning.budget == 12,
           f"two 8-token prompts in a 3-block pool: chunks {_chunks_of(planning)}, {planning.budget} budget left; expected "
           "only p1's chunk and 12 left (p2 could not get blocks)", "when self._reserve returns False (no blocks: the "
           "sequence was preempted) add no chunk and spend no budget")


def _params(n: int):
    from nanoserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _mixed():
    """One short request that is decoding when two long prompts arrive (all prompts > the budget but one)."""
    return [("short", prompts(1, 5, seed=1)[0], _params(12)),
            ("long1", prompts(1, 21, seed=2)[0], _params(4)),
            ("long2", prompts(1, 13, seed=3)[0], _params(4))]


def _chunks(result) -> list[ChunkScheduled]:
    return [e for e in result.events if isinstance(e, ChunkScheduled)]


def budget_respected(ctx: Context) -> None:
    def on_step(engine, result, before):
        n = sum(c.num_tokens for c in _chunks(result))
        expect(n <= BUDGET, f"step {result.stats.step} computed {n} tokens with max_num_batched_tokens={BUDGET}",
               "_schedule_running (or _chunk_size): no chunk may be larger than the budget that is left, and what is "
               "planned must come off that budget")
    run_engine(ctx, ctx.components(), _mixed(), {"max_num_batched_tokens": BUDGET, "num_blocks": 32},
               on_step=on_step)


def decodes_first(ctx: Context) -> None:
    def on_step(engine, result, before):
        decoding = {r["seq_id"] for r in before["sequences"] if r["status"] == "running"
                    and r["num_prompt_tokens"] + r["num_output_tokens"] - r["num_computed_tokens"] == 1}
        chunks = _chunks(result)
        got = {c.seq_id for c in chunks}
        starved = sorted(decoding - got)
        expect(not starved, f"step {result.stats.step}: {', '.join(starved)} was decoding but got no token while "
               f"prefill chunks took the budget ({[(c.seq_id, c.num_tokens) for c in chunks]})",
               "schedule decodes first (one token each), then prefill chunks with what is left: a decode "
               "costs one token, and starving it stalls a request that is already streaming")
        kinds = [c.is_prefill for c in chunks]
        expect(kinds == sorted(kinds), f"step {result.stats.step}: a decode came after a prefill chunk",
               "decodes first, then prefill chunks")
    run_engine(ctx, ctx.components(), _mixed(), {"max_num_batched_tokens": BUDGET, "num_blocks": 32},
               on_step=on_step)


def chunked_prefill(ctx: Context) -> None:
    sizes: list[int] = []

    def on_step(engine, result, before):
        sizes.extend(c.num_tokens for c in _chunks(result) if c.seq_id == "long" and c.is_prefill)
    try:
        run_engine(ctx, ctx.components(), [("long", prompts(1, 21, seed=2)[0], _params(3))],
                   {"max_num_batched_tokens": BUDGET, "num_blocks": 32}, max_steps=40, on_step=on_step)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc} (a 21-token prompt, budget {BUDGET})",
                          "with chunked prefill a prompt longer than the budget is split into chunks of the "
                          "budget; _chunk_size must not return 0 for it") from None
    expect(sizes == [8, 8, 5], f"a 21-token prompt with budget {BUDGET} was computed in chunks {sizes}, "
           "expected [8, 8, 5]", "with chunked prefill, cut the prompt to the budget each step")


def whole_prompts(ctx: Context) -> None:
    def on_step(engine, result, before):
        left = {r["seq_id"]: r["num_prompt_tokens"] - r["num_computed_tokens"] for r in before["sequences"]}
        for c in _chunks(result):
            if c.is_prefill and c.seq_id in left and left[c.seq_id] > 0:
                expect(c.num_tokens == left[c.seq_id],
                       f"step {result.stats.step}: {c.seq_id} computed {c.num_tokens} of its {left[c.seq_id]} "
                       "prompt tokens with enable_chunked_prefill=False",
                       "_chunk_size: without chunked prefill a prompt runs whole or not at all; what happens to one "
                       "that does not fit in the budget left?")
    reqs = [("a", prompts(1, 12, seed=1)[0], _params(4)), ("b", prompts(1, 12, seed=4)[0], _params(4))]
    run_engine(ctx, ctx.components(), reqs, {"max_num_batched_tokens": 20, "num_blocks": 32,
                                               "enable_chunked_prefill": False}, on_step=on_step)


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0)) for i, p in enumerate(prompts(5, 17, shared=4))]
    reqs.append(("spec", [4, 5, 6] * 5, SamplingParams(max_tokens=9, temperature=0)))
    same_as_engine(ctx, reqs, {"max_num_batched_tokens": 12, "num_blocks": 18, "speculative_method": "ngram",
                               "num_speculative_tokens": 2},
                   "the engine's tokens differ with your scheduler: every sequence must compute exactly its "
                   "uncomputed tokens (plus drafts that fit), never a token twice or skipped")


LAB = Lab(
    name="scheduler-budget",
    title="the scheduler's token budget: decodes first, chunked prefill",
    module="nanoserve.scheduler",
    blanks={
        "Scheduler._schedule_running": "decodes = running sequences with 1 uncomputed token, prefills = those "
                                       "still prefilling; for each (decodes first) while planning.budget > 0: skip "
                                       "one that is no longer RUNNING; num_new = min(uncomputed + drafts, "
                                       "planning.budget); keep the drafts that fit; if self._reserve(...) add the "
                                       "chunk (self._add_chunk) and subtract num_new from planning.budget",
        "Scheduler._chunk_size": "num_new = tokens not yet computed (nor cached); if it exceeds the budget: the "
                                 "budget with chunked prefill on, else 0 (wait for a step with room)",
    },
    contracts={
        "Scheduler._schedule_running": "Adds a chunk to planning.plan for every running sequence with tokens to "
                                       "compute, as far as planning.budget goes: decodes (one uncomputed token, plus "
                                       "the drafts that fit) before prefill chunks, each in admission order, a "
                                       "chunk never larger than the budget left, only with blocks reserved "
                                       "(self._reserve); a sequence no longer RUNNING is skipped. planning.budget "
                                       "drops by every chunk's tokens.",
        "Scheduler._chunk_size": "The tokens of `seq` to compute this step: those without KV and not cached, "
                                 "cut to `budget` with chunked prefill; without it, 0 when they do not all fit.",
    },
    invariants="A step computes at most max_num_batched_tokens tokens. A running sequence holds blocks for every "
               "token it has KV for, and reserves blocks for the tokens of its chunk before the chunk is added. "
               "Decodes come before prefill chunks.",
    components=lambda m: Components(scheduler=m.Scheduler),
    checks=(
        SIGNATURES,
        Check("Scheduler._chunk_size: the budget, with and without chunking", chunk_size, CHUNK_HINT, 60,
              function="Scheduler._chunk_size"),
        Check("Scheduler._schedule_running: decodes first, within the budget", schedule_running, RUNNING_HINT, 60,
              function="Scheduler._schedule_running"),
        Check("real engine: never more tokens than the budget", budget_respected,
              "_schedule_running or _chunk_size: no step may plan more tokens than the budget", 120),
        Check("real engine: decodes first", decodes_first, "_schedule_running: which kind of sequence goes first?", 120),
        Check("real engine: chunked prefill splits a long prompt", chunked_prefill,
              "_chunk_size: with chunked prefill, how much of a prompt longer than the budget runs each step?", 120),
        Check("real engine: without chunked prefill prompts run whole", whole_prompts,
              "_chunk_size: without chunked prefill, a prompt runs whole or waits", 120),
        Check("real engine: same tokens (with speculation, small pool)", engine_runs,
              "_schedule_running (the drafts that fit) or _chunk_size (cached tokens): compare your "
              "StepResult.stats with the engine's own", 240),
    ),
    why=(
        ("Why do decodes go before prefill chunks?",
         "A decode is one token for a request that is already streaming to a user; a prefill chunk is many "
         "tokens for one that has not started. Starving the decode stalls a visible stream for the sake of "
         "a first token that can wait a step: decodes first keeps the time between tokens flat."),
        ("Why cut a long prompt into chunks instead of running it whole?",
         "A whole 2000-token prompt in one step makes every decoding request wait for that step: their "
         "inter-token latency spikes. Chunks of the budget spread the prompt over steps that still carry "
         "every decode."),
        ("Without chunked prefill, why does a prompt that does not fit wait instead of taking what is left?",
         "Its whole prompt must be computed in one step (that is what switching chunking off means), so taking "
         "part of the budget would leave it half-computed; it waits for a step with room, and the requests "
         "behind it in the queue wait too (first come, first served)."),
    ),
    prerequisites="the block-pool lab; lesson 1 (paged KV and batching)",
    minutes=45,
)
