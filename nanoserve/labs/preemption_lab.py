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

from nanoserve.components import Components
from nanoserve.events import Preempted
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, run_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect
from nanoserve.labs.run import invariant_text

VICTIM_HINT = ("the victim is chosen by preemption_policy among running sequences NOT already in this step's "
               "batch: 'newest' = the most recently admitted, 'priority' = the lowest priority (ties: newest), "
               "'shortest_remaining' = the most tokens still to generate")


BOOKKEEPING_HINT = ("a preempted request must come back with every token it had: with recompute, release its "
                    "blocks (self.kv.release), set num_computed_tokens to 0 (its KV is computed again) and keep "
                    "its tokens")


def _pressure():
    """Four requests that cannot all fit: different lengths and priorities, so the policies disagree."""
    from nanoserve.sampling_params import SamplingParams
    return [(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), prio)
            for i, (p, m, prio) in enumerate(zip(prompts(4, 7, seed=11), (14, 9, 16, 12), (2, 0, 3, 1)))]


def _trace(ctx: Context, components, config: dict):
    """Every preemption (step, request, mode) and the final tokens, for one run."""
    seen: list[tuple[int, str, str]] = []

    def on_step(engine, result, before):
        seen.extend((e.step, e.seq_id, e.mode) for e in result.events if isinstance(e, Preempted))
    _, outputs = run_engine(ctx, components, _pressure(), config, on_step=on_step)
    return seen, outputs


def _same_preemptions(ctx: Context, config: dict, hint: str) -> None:
    want, want_out = _trace(ctx, Components(), config)
    assert want, "the scenario preempts nothing (a lab bug)"
    try:
        got, got_out = _trace(ctx, ctx.components(), config)
    except CheckFailed:
        raise
    except AssertionError as exc:
        raise CheckFailed(f"invariant broken: {invariant_text(exc)}", BOOKKEEPING_HINT) from None
    for i, (w, g) in enumerate(zip(want + [None] * len(got), got + [None] * len(want))):
        if w != g:
            raise CheckFailed(f"preemption #{i + 1}: yours {g} (step, request, mode), the engine's {w}", hint)
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
    _same_preemptions(ctx, {"num_blocks": 9, "preemption_mode": "swap", "num_cpu_blocks": 16},
                      "with preemption_mode='swap' a victim that has blocks and fits in the CPU pool "
                      "(self.kv.can_swap_out) is swapped out (status SWAPPED, self.kv.swap_out, self.swapped); "
                      "only otherwise is it recomputed")


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
        "Scheduler._preempt": "remove from running, append to out.preempted; swap mode (and it has blocks and "
                              "self.kv.can_swap_out): status SWAPPED, emit Preempted(..., 'swap', 0), "
                              "self.kv.swap_out, append to self.swapped. Else: status WAITING, emit "
                              "Preempted(..., 'recompute', tokens lost), self.kv.release, num_computed_tokens = 0, "
                              "appendleft to self.waiting",
    },
    components=lambda m: Components(scheduler=m.Scheduler),
    checks=(
        SIGNATURES,
        Check("a lone request too big for the pool ends, with an error", lone_too_big,
              "a sequence that cannot fit even alone in the pool must be failed, not retried", 120),
        Check("victim: the newest, never one in this step's batch", newest, VICTIM_HINT, 180),
        Check("victim by priority and by shortest remaining", policies, VICTIM_HINT, 240),
        Check("swap mode: KV to the CPU pool and back", swap,
              "with preemption_mode='swap' the victim's KV moves to the CPU pool", 180),
    ),
    prerequisites="the block-pool lab; lesson 6 (preemption)",
    minutes=50,
)
