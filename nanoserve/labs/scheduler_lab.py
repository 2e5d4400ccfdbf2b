"""Lab scheduler-budget: the token budget, decodes first, chunked prefill (nanoserve/scheduler.py).

The student writes `Scheduler._schedule_running` (passes 1 and 2 of a step:
running sequences, decodes before prefill chunks, within the budget) and
`_chunk_size` (how much of a prompt fits: cut to the budget with chunked
prefill, or wait for a step with room without it). Admission, preemption
and the block work stay the engine's. The checks watch every step of the
real engine: its token count, which requests it left out, its chunks.
"""

from __future__ import annotations

from nanoserve.components import Components
from nanoserve.events import ChunkScheduled
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, run_engine, same_as_engine
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect

BUDGET = 8


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
               "cut every chunk to the budget that is left (min(tokens to compute, budget)) and subtract it")
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
                       "without chunked prefill a prompt runs whole: if it does not fit in the budget left, "
                       "_chunk_size returns 0 and it waits for a step with room")
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
                                       "still prefilling; for each (decodes first) while plan.budget > 0: skip "
                                       "one that is no longer RUNNING; num_new = min(uncomputed + drafts, "
                                       "plan.budget); keep the drafts that fit; if self._reserve(...) add the "
                                       "chunk (self._add_chunk) and subtract num_new from plan.budget",
        "Scheduler._chunk_size": "num_new = tokens not yet computed (nor cached); if it exceeds the budget: the "
                                 "budget with chunked prefill on, else 0 (wait for a step with room)",
    },
    components=lambda m: Components(scheduler=m.Scheduler),
    checks=(
        SIGNATURES,
        Check("never more tokens than the budget", budget_respected,
              "cut every chunk to the budget that is left", 120),
        Check("decodes first", decodes_first, "schedule decodes before prefill chunks", 120),
        Check("chunked prefill splits a long prompt", chunked_prefill,
              "with chunked prefill, a prompt longer than the budget is cut to the budget each step", 120),
        Check("without chunked prefill prompts run whole", whole_prompts,
              "without chunked prefill a prompt that does not fit waits for a step with room", 120),
        Check("real engine: same tokens (with speculation, small pool)", engine_runs,
              "run the engine with your scheduler and compare its StepResult.stats with the engine's own", 240),
    ),
    prerequisites="the block-pool lab; lesson 1 (paged KV and batching)",
    minutes=45,
)
