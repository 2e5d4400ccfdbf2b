"""Lab preemption: making room when the pool runs out (nanoserve/scheduler.py).

The student writes `Scheduler._reserve` (get blocks for a running
sequence, preempting others until they fit), `_victim` (whom to preempt,
by `preemption_policy`) and `_preempt` (recompute: free the blocks and
queue the sequence at the front to compute its KV again; swap: move its KV
to the CPU pool). The checks squeeze the real engine into a small pool and
compare every preemption, and every token, with the engine's own scheduler;
one scenario is a lone request that outgrows the whole pool, which must end
with an error instead of waiting forever.
"""

from __future__ import annotations

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.events import Preempted, StepClock
from nanoserve.kv_manager import BlockMoves
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, run_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect
from nanoserve.labs.load import invariant_text

VICTIM_HINT = ('the victim: which running sequences may be taken at all (think of those this step has already '
               'planned), and what does each preemption_policy rank by? Compare the one you chose with the '
               'expected one, and check how ties are broken')


BOOKKEEPING_HINT = ('a preempted request must later produce exactly the tokens it would have: what must it keep, '
                    'what must it give back, and what may the engine still believe about its KV once its blocks '
                    'are gone?')


class Setup:
    """The engine's config, pools, KV manager and sequences (here); the student's scheduler (in the worker)."""

    def __init__(self, ctx: Context, num_blocks: int = 16, num_cpu_blocks: int = 0, cache: bool = False,
                 **config) -> None:
        from nanoserve.config import EngineConfig
        from nanoserve.kv_manager import KVManager
        from nanoserve.radix_cache import RadixCache
        self.config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=num_blocks,
                                   num_cpu_blocks=num_cpu_blocks, **config)
        self.pool = BlockPool(num_blocks, 4)
        self.cpu_pool = BlockPool(num_cpu_blocks, 4) if num_cpu_blocks else None
        self.events: list = []
        self.clock = StepClock()
        self.clock.step = 7
        self.radix = RadixCache(self.pool, self.events.append, clock=self.clock) if cache else None
        self.kv = KVManager(self.pool, self.radix, self.cpu_pool, self.events.append, clock=self.clock)
        self.moves = BlockMoves()
        self.kv.begin_step(self.moves)
        self.sched = ctx.module.Scheduler(self.config, self.kv, self.events.append, clock=self.clock)

    def seq(self, seq_id: str, computed: int, output: int = 1, priority: int = 0, max_tokens: int = 20,
            request_id: str = ""):
        """A running decode: `computed` tokens with KV (and their blocks), `output` of them generated."""
        from nanoserve.sampling_params import SamplingParams
        from nanoserve.sequence import Sequence, SequenceStatus
        seq = Sequence(seq_id, None, list(range(10, 10 + computed + 1 - output)), SamplingParams(max_tokens=max_tokens),
                       status=SequenceStatus.RUNNING, output_token_ids=list(range(50, 50 + output)),
                       priority=priority, request_id=request_id)
        seq.block_table = self.pool.allocate(self.pool.blocks_needed(0, computed))
        seq.num_computed_tokens = computed
        self.sched.running.append(seq)
        return seq

    def plan(self):
        from nanoserve.scheduler import StepPlan
        return StepPlan()


def _ids(seqs) -> list[str]:
    return [s.seq_id for s in seqs]


def victim(ctx: Context) -> None:
    for policy, cases in (("newest", (((), "e"), (("e",), "d"), (("d", "e"), "c"))),
                          ("priority", (((), "c"), (("c",), "b"), (("b", "c"), "a"))),
                          ("shortest_remaining", (((), "b"), (("b",), "e"), (("b", "e"), "d"),
                                                  (("b", "d", "e"), "a")))):
        s = Setup(ctx, preemption_policy=policy)
        a = s.seq("a", 8, output=5, priority=2)           # remaining 15
        s.seq("b", 8, output=1, priority=0)               # remaining 19
        s.seq("c", 8, output=10, priority=0)              # remaining 10
        s.seq("d", 8, output=2, priority=3)               # remaining 18
        s.seq("e", 8, output=2, priority=3, max_tokens=20)   # remaining 18, like d, admitted after it
        for scheduled, want in cases:
            got = s.sched._victim(a, set(scheduled))
            expect(got is not None and got.seq_id == want,
                   f"preemption_policy={policy!r}: running a (priority 2, 15 tokens to go), b (0, 19), c (0, 10), "
                   f"d (3, 18), e (3, 18), admitted in that order, {sorted(scheduled) or 'none'} already in this "
                   "step's batch: "
                   f"the victim for a was {getattr(got, 'seq_id', got)}, expected {want}", VICTIM_HINT)
    s = Setup(ctx)
    a = s.seq("a", 8)
    stuck = []
    for beam_id in ("e.1", "e.3"):
        beam = s.seq(beam_id, 9, output=2, request_id="e")
        beam.num_computed_tokens = beam.num_tokens      # nothing left to compute: it waits for its sibling
        stuck.append(beam)
    s.seq("f", 8)
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.sequence import Sequence
    s.sched.waiting.append(Sequence("e.2", None, [1, 2, 3], SamplingParams(max_tokens=4), request_id="e"))
    got = s.sched._victim(a, set())
    expect(got is stuck[-1], f"two running beams (e.1, then e.3) wait for a preempted sibling (stuck): the victim "
           f"was {getattr(got, 'seq_id', got)}, expected e.3", "a stuck beam of another request is preempted first "
           "(self._stuck_beams), the newest of them: it holds blocks and makes no progress")


PREEMPT_HINT = ('_preempt: follow the sequence through both modes. Where does it wait afterwards: which queue, '
                'and at which end (who should run first when room comes back)? Which status and which event? Who '
                'holds its blocks or its KV now? The plan must list it as preempted')


def preempt(ctx: Context) -> None:
    from nanoserve.sequence import SequenceStatus
    for mode, cpu_blocks, want in (("recompute", 0, "recompute"), ("swap", 8, "swap"), ("swap", 1, "recompute")):
        s = Setup(ctx, num_cpu_blocks=cpu_blocks, preemption_mode=mode)
        s.seq("a", 8)
        b = s.seq("b", 10, output=3)
        blocks, tokens = list(b.block_table), b.all_token_ids
        queued = s.seq("w", 0)
        s.sched.running.remove(queued)
        queued.block_table, queued.status = [], SequenceStatus.WAITING
        s.sched.waiting.append(queued)
        plan = s.plan()
        s.sched._preempt(b, plan)
        what = f"_preempt(b) in {mode} mode with {cpu_blocks} CPU blocks ({len(blocks)} needed)"
        expect(_ids(s.sched.running) == ["a"] and _ids(plan.preempted) == ["b"],
               f"{what}: running is {_ids(s.sched.running)} and plan.preempted {_ids(plan.preempted)}", PREEMPT_HINT)
        pre = [e for e in s.events if isinstance(e, Preempted)]
        lost = 0 if want == "swap" else 10
        expect(len(pre) == 1 and (pre[0].step, pre[0].seq_id, pre[0].mode, pre[0].num_tokens_lost) ==
               (7, "b", want, lost), f"{what} emitted {pre}, expected Preempted(7, 'b', {want!r}, {lost})",
               PREEMPT_HINT)
        expect(b.all_token_ids == tokens, f"{what} changed b's tokens", "a preempted sequence keeps every token")
        if want == "swap":
            expect(b.status is SequenceStatus.SWAPPED and _ids(s.sched.swapped) == ["b"] and
                   _ids(s.sched.waiting) == ["w"] and not b.block_table and len(b.cpu_block_table) == len(blocks)
                   and b.num_computed_tokens == 10,
                   f"{what}: status {b.status.name}, swapped {_ids(s.sched.swapped)}, waiting "
                   f"{_ids(s.sched.waiting)}, {len(b.cpu_block_table)} CPU blocks, {b.num_computed_tokens} computed",
                   "with room in the CPU pool the victim is swapped: where does its KV go, is it still computed, "
                   "and which queue holds it until it comes back?")
        else:
            expect(b.status is SequenceStatus.WAITING and _ids(s.sched.waiting) == ["b", "w"] and
                   not b.block_table and b.num_computed_tokens == 0 and
                   all(s.pool.blocks[x].ref_count == 0 for x in blocks),
                   f"{what}: status {b.status.name}, waiting {_ids(s.sched.waiting)}, table {list(b.block_table)}, "
                   f"{b.num_computed_tokens} computed (expected WAITING, waiting ['b', 'w'], table [], 0 computed)",
                   BOOKKEEPING_HINT + "; and where in the queue should it wait? It was running before anyone "
                   "waiting")
    s = Setup(ctx, cache=True)                    # the prefix cache on: what a recompute may keep
    s.seq("a", 8)
    b = s.seq("b", 10, output=3)
    s.sched._preempt(b, s.plan())
    _, cached = s.radix.match_prefix(b.all_token_ids)
    expect(len(cached) == 2, f"_preempt(b) in recompute mode with the prefix cache on: {len(cached)} of the 2 full "
           "blocks of b's 10 computed tokens are in the cache afterwards, expected 2",
           "the KV of a recomputed victim's full blocks is still valid: where can it be kept, so that its own "
           "recompute (or another request with the same prefix) need not compute it again?")
    s = Setup(ctx, num_cpu_blocks=8, preemption_mode="swap")
    b = s.seq("b", 0, output=0)
    s.sched._preempt(b, s.plan())
    expect(b.status is SequenceStatus.WAITING, f"a victim with no blocks in swap mode became {b.status.name}",
           "only a victim that has blocks is swapped (nothing to move otherwise): recompute it")


RESERVE_HINT = ("_reserve: its question is whether this sequence's next write fits in the blocks still free; each"
                ' preemption frees some. Think of the victim being the sequence itself, and of a sequence that '
                'could never fit, even alone: neither may loop forever or leave it half scheduled')


def reserve(ctx: Context) -> None:
    from nanoserve.sequence import SequenceStatus
    s = Setup(ctx, num_blocks=10)
    a = s.seq("a", 8)
    plan = s.plan()
    got = s.sched._reserve(a, 1, {"a"}, plan)
    expect(got is True and len(a.block_table) == 3 and not plan.preempted,
           f"_reserve(a, 1) with 8 free blocks returned {got}, a holds {len(a.block_table)} blocks, preempted "
           f"{_ids(plan.preempted)}", "with room, grow the table (self.kv.grow) and return True, preempting nobody")

    s = Setup(ctx, num_blocks=5)
    a = s.seq("a", 12)
    s.seq("b", 4)
    s.seq("c", 4)
    plan = s.plan()
    got = s.sched._reserve(a, 8, {"a"}, plan)
    expect(got is True and _ids(plan.preempted) == ["c", "b"] and len(a.block_table) == 5,
           f"_reserve(a, 8 tokens = 2 blocks) in a full 5-block pool returned {got}, preempted "
           f"{_ids(plan.preempted)}, a holds {len(a.block_table)} blocks; expected True, [c, b] (newest first, "
           "until it fits) and 5", RESERVE_HINT)

    s = Setup(ctx, num_blocks=4)
    s.seq("b", 4)
    a = s.seq("a", 8)
    plan = s.plan()
    got = s.sched._reserve(a, 8, {"b"}, plan)
    expect(got is False and _ids(plan.preempted) == ["a"] and a.status is SequenceStatus.WAITING,
           f"_reserve(a, 8) where the only victim is a itself (and its 16 tokens would fill the empty 4-block pool "
           f"exactly) returned {got}, preempted {_ids(plan.preempted)}, a is {a.status.name}",
           "when the victim is seq itself and it would fit in an empty pool (exactly full counts as fitting), "
           "preempt it and return False: it waits for room")

    s = Setup(ctx, num_blocks=4)
    a = s.seq("a", 16)
    plan = s.plan()
    got = s.sched._reserve(a, 1, set(), plan)
    expect(got is False and _ids(plan.failed) == ["a"] and not s.sched.running and not s.sched.waiting and
           a.status is SequenceStatus.FINISHED_ABORTED and a.error and not a.block_table,
           f"_reserve(a, 1) for a sequence of 16 tokens in a 4-block pool (it needs 5 blocks even alone) returned "
           f"{got}; failed {_ids(plan.failed)}, running {_ids(s.sched.running)}, waiting {_ids(s.sched.waiting)}, "
           f"status {a.status.name}", "a lone request too big for the pool livelocks the scheduler: when the only "
           "victim is the sequence itself and it would not fit even in an empty pool, remove it from running and "
           "fail it (self._fail) instead of waiting for room that never comes")


def _pressure():
    """Four requests that cannot all fit: different lengths and priorities, so the policies disagree."""
    from nanoserve.sampling_params import SamplingParams
    return [(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), prio)
            for i, (p, m, prio) in enumerate(zip(prompts(4, 7, seed=11), (14, 9, 16, 12), (2, 0, 3, 1)))]


def _trace(ctx: Context, components, config: dict):
    """Every preemption (step, request, mode), where each victim then waits (its queue's name and its place
    there), and the final tokens, for one run."""
    seen: list[tuple[int, str, str]] = []
    places: list[tuple[str, int]] = []

    def on_step(engine, result, before):
        for e in result.events:
            if isinstance(e, Preempted):
                seen.append((e.step, e.seq_id, e.mode))
                queues = (("waiting", engine.scheduler.waiting), ("swapped", engine.scheduler.swapped))
                places.append(next(((name, i) for name, queue in queues
                                    for i, seq in enumerate(queue) if seq.seq_id == e.seq_id), ("nowhere", -1)))
    _, outputs = run_engine(ctx, components, _pressure(), config, on_step=on_step)
    return seen, places, outputs


WAIT_HINT = ("_preempt decides where a victim waits: which queue, and at which end? A preempted request was "
             "running before anyone who is waiting; who should get the next free blocks?")
MODE_HINT = ("_preempt: the victim was the same, its mode was not: when is a victim swapped (its KV kept in the "
             "CPU pool) and when is it recomputed?")
WHEN_HINT = ("_reserve decides whether anyone must be preempted at all: it preempts only while this sequence's "
             "next write does not fit in the free blocks, and stops as soon as it does")


def _same_preemptions(ctx: Context, config: dict, hint: str) -> None:
    """The student's scheduler preempts the same requests, at the same steps, in the same mode, re-queued in the
    same place, with the same tokens at the end, as the engine's own; a difference names the function most
    likely at fault (a different victim at the same step: _victim; the same victim in another mode or queue
    place: _preempt; a preemption at another step: _reserve)."""
    want, want_places, want_out = _trace(ctx, Components(), config)
    assert want, "the scenario preempts nothing (a lab bug)"
    try:
        got, got_places, got_out = _trace(ctx, ctx.components(), config)
    except CheckFailed:
        raise
    except AssertionError as exc:
        raise CheckFailed(f"invariant broken: {invariant_text(exc)} (the function most likely at fault: _preempt, "
                          "which sets what a preempted request keeps)", BOOKKEEPING_HINT) from None
    for i, (w, g) in enumerate(zip(want + [None] * len(got), got + [None] * len(want))):
        if w == g:
            if w is not None and want_places[i] != got_places[i]:
                raise CheckFailed(f"preemption #{i + 1} {g} (step, request, mode): then the victim waits in "
                                  f"{got_places[i][0]} at place {got_places[i][1]}, with the engine's own in "
                                  f"{want_places[i][0]} at place {want_places[i][1]} (the function most likely at "
                                  "fault: _preempt)", WAIT_HINT)
            continue
        which, why = ("_victim", hint) if w and g and w[0] == g[0] and w[1] != g[1] else \
            ("_preempt", MODE_HINT) if w and g and w[:2] == g[:2] else ("_reserve", WHEN_HINT)
        raise CheckFailed(f"preemption #{i + 1}: yours {g} (step, request, mode), the engine's {w} (the function "
                          f"most likely at fault: {which})", why)
    for rid, tokens in want_out.items():
        expect(got_out.get(rid) == tokens, f"request {rid}: got tokens {got_out.get(rid)}, the engine's own {tokens}",
               BOOKKEEPING_HINT)


def lone_too_big(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    reqs = [("big", prompts(1, 6, seed=3)[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    try:
        engine, outputs = run_engine(ctx, ctx.components(), reqs, {"num_blocks": 4, "max_model_len": 64},
                                     max_steps=80)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc} (one request that outgrows a 4-block pool)",
                          "a lone request too big for the pool livelocks the scheduler: when the only victim is "
                          "the sequence itself and it would not fit even in an empty pool, fail it (self._fail) "
                          "instead of waiting for room that never comes") from None
    expect("big" in outputs, "the request never finished")
    expect(len(outputs["big"][0]) < 40, f"the request generated {len(outputs['big'][0])} tokens in a pool of "
           "16 token slots", "a request cannot hold more tokens than the pool has slots")


def newest(ctx: Context) -> None:
    _same_preemptions(ctx, {"num_blocks": 9, "max_num_batched_tokens": 32}, VICTIM_HINT)


def policies(ctx: Context) -> None:
    for policy in ("priority", "shortest_remaining"):
        _same_preemptions(ctx, {"num_blocks": 9, "preemption_policy": policy}, VICTIM_HINT)


def swap(ctx: Context) -> None:
    _same_preemptions(ctx, {"num_blocks": 9, "preemption_mode": "swap", "num_cpu_blocks": 16}, VICTIM_HINT)


LAB = Lab(
    name="preemption",
    title="preemption: victim choice, recompute and swap, no livelock",
    module="nanoserve.scheduler",
    starter_name="scheduler_preemption.py",
    blanks={
        "Scheduler._reserve": "while self.kv.blocks_to_write(seq, num_new) > self.kv.num_available_blocks: pick "
                              "a victim; if it is seq itself and seq would not fit even in an empty pool, remove "
                              "it from running and self._fail it (return False); else preempt the victim and "
                              "return False if it was seq. When there is room: self.kv.grow(seq, num_new), True",
        "Scheduler._victim": "a stuck beam of another request first (self._stuck_beams); else among running "
                             "sequences not in `scheduled`, the max by policy: newest = admission index, priority "
                             "= (-priority, index), shortest_remaining = (max_tokens - num_output_tokens, index)",
        "Scheduler._preempt": "remove from running, append to plan.preempted; swap mode (and it has blocks and "
                              "self.kv.can_swap_out): status SWAPPED, emit Preempted(..., 'swap', 0), "
                              "self.kv.swap_out, append to self.swapped. Else: status WAITING, emit "
                              "Preempted(..., 'recompute', tokens lost), self.kv.release(seq, cache_kv=True), num_computed_tokens = 0, "
                              "appendleft to self.waiting",
    },
    contracts={
        "Scheduler._reserve": "Afterwards `seq` holds blocks for num_new more tokens (self.kv.grow) and True is "
                              "returned, having preempted as few victims as needed (self._victim, "
                              "self._preempt); or `seq` itself was the victim (False); or `seq` could not fit "
                              "even alone in the pool, and it is out of running and failed (self._fail, False).",
        "Scheduler._victim": "The running sequence to preempt for `seq`, never one in `scheduled`: a stuck beam "
                             "of another request first (self._stuck_beams), else by preemption_policy: newest = "
                             "the most recently admitted; priority = the lowest priority, ties the newest; "
                             "shortest_remaining = the most tokens still to generate, ties the newest.",
        "Scheduler._preempt": "`seq` leaves running and joins plan.preempted. In swap mode, when it has blocks "
                              "and they fit in the CPU pool: its KV moves there (self.kv.swap_out), status "
                              "SWAPPED, at the end of self.swapped. Else: its blocks are released (the KV of its "
                              "full blocks stays in the prefix cache: it is valid), nothing is computed, status "
                              "WAITING, at the FRONT of self.waiting. Its tokens are kept; "
                              "Preempted is emitted with the mode and the tokens of KV lost.",
    },
    invariants="A running sequence holds blocks for every token it has KV for; a waiting one holds none and has "
               "0 tokens computed; a swapped one holds CPU blocks for its computed tokens. A sequence in this "
               "step's batch (`scheduled`) is never preempted.",
    components=lambda m: Components(scheduler=m.Scheduler),
    checks=(
        SIGNATURES,
        Check("Scheduler._victim: by policy, never one in the batch", victim, VICTIM_HINT, 60,
              function="Scheduler._victim"),
        Check("Scheduler._preempt: recompute or swap, tokens kept", preempt, PREEMPT_HINT, 60,
              function="Scheduler._preempt"),
        Check("Scheduler._reserve: blocks, victims, or a failure", reserve, RESERVE_HINT, 60,
              function="Scheduler._reserve"),
        Check("real engine: a lone request too big for the pool ends, with an error", lone_too_big,
              "_reserve: a sequence that cannot fit even alone in the pool must be failed, not retried", 120),
        Check("real engine: the newest is preempted, never one in this step's batch", newest, VICTIM_HINT, 180),
        Check("real engine: victims by priority and by shortest remaining", policies, VICTIM_HINT, 240),
        Check("real engine: swap mode, KV to the CPU pool and back", swap,
              "_preempt (the mode) or _victim (whom): with preemption_mode='swap' the victim's KV moves to the "
              "CPU pool", 180),
    ),
    why=(
        ("Why preempt the newest request by default, and not the one holding the most blocks?",
         "The newest has had the least work done for it, so recomputing it throws away the least; the oldest "
         "requests keep going and finish, which frees their blocks for good. Preempting the biggest would "
         "punish exactly the requests closest to being done."),
        ("Why does a recomputed victim wait at the front of the queue, not the back?",
         "It was running before anyone in the queue was admitted: first come, first served. At the back it "
         "could be overtaken again and again by newer requests and starve."),
        ("Why can a lone request too big for the pool not simply wait for room?",
         "Room comes only from other requests finishing. When it is the only one running and would not fit "
         "even in an empty pool, nothing will ever free enough: the scheduler preempts it, readmits it, preempts "
         "it, forever (a livelock). Failing it with an error is the only step that makes progress."),
    ),
    prerequisites="the block-pool lab; lesson 6 (preemption)",
    minutes=50,
)
