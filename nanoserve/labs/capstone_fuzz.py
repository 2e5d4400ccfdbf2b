"""The capstone's state-machine stage: thousands of seeded random operations on the student's whole engine.

The operations are the engine state machine's (tests/test_engine_stateful.py), drawn here from a seeded
`random.Random` instead of Hypothesis, so that a plan is plain data the judge can send and run twice: add a
request (greedy, seeded sampling, n > 1, beam search, stop ids, shared prefixes), step one or several times,
abort a request or one of its forks, fork a running sequence, evict cached blocks, and at the end drain
everything and clear the prefix cache. Each plan runs on a small pool of the tiny random Llama (memory
pressure: preemption by recompute, or by swap under the priority policy; copy-on-write, prefix-cache hits and
evictions), which is cheap enough for thousands of operations.

`run_plan` applies a plan to one engine and records, after each operation, what an observer can see: the
operation's outcome (its exception's type, or "ok"), the events it emitted, the engine's snapshot, and what
`check_invariants()` raised. The judge (nanoserve_labkit/capstone_fuzz.py) runs the same plan on the
reference engine in its own process and compares operation by operation; this module only runs a plan.
"""

from __future__ import annotations

import random

# The engines the stage runs: (name, EngineConfig fields). Small pools: preemption, swapping, copy-on-write.
CONFIGS = (
    ("recompute", dict(block_size=4, num_blocks=14, max_num_batched_tokens=16, max_num_seqs=4,
                       enable_prefix_caching=True)),
    ("swap", dict(block_size=4, num_blocks=12, max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=True,
                  preemption_mode="swap", num_cpu_blocks=10, preemption_policy="priority")),
)
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9] * 5)
MAX_LIVE = 6
MAX_DRAIN_STEPS = 2000


def make_plan(seed: int, num_ops: int, vocab: int = 256) -> list[list]:
    """`num_ops` operations drawn from `random.Random(seed)`, then a drain: a list of JSON-able lists.
    Targets of abort and fork are indices (taken modulo the live ids when the operation runs), so a plan
    does not depend on the engine it runs on."""
    rng = random.Random(seed)
    plan: list[list] = []
    for i in range(num_ops):
        kind = rng.choices(("add", "beam", "step", "steps", "abort", "abort_seq", "fork", "evict"),
                           weights=(22, 3, 30, 12, 6, 3, 6, 4))[0]
        if kind == "add":
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
            if rng.random() < 0.3:
                prompt = list(rng.choice(PREFIXES)) + prompt[:6]
            mode = rng.choice(("greedy", "greedy", "seeded"))
            params = {"max_tokens": rng.randint(1, 16), "temperature": 0.0 if mode == "greedy" else 1.0,
                      "seed": rng.randrange(2**31) if mode == "seeded" else None, "n": rng.choice((1, 1, 1, 2)),
                      "stop_token_ids": [rng.randrange(vocab)] if rng.random() < 0.2 else []}
            plan.append(["add", f"q{i}", prompt, params, rng.randint(0, 2)])
        elif kind == "beam":
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            plan.append(["add", f"b{i}", prompt, {"beam_width": 2, "n": 1, "temperature": 0.0,
                                                  "max_tokens": rng.randint(1, 6)}, 0])
        elif kind == "steps":
            plan.append(["step", rng.randint(2, 5)])
        elif kind == "step":
            plan.append(["step", 1])
        elif kind == "evict":
            plan.append(["evict", rng.randint(1, 4)])
        elif kind == "fork":
            plan.append(["fork", rng.randrange(1000), rng.randrange(2**31)])
        else:
            plan.append([kind, rng.randrange(1000)])
    plan.append(["drain"])
    return plan


def _picked(ids, index: int) -> str | None:
    ids = sorted(ids)
    return ids[index % len(ids)] if ids else None


def _apply(engine, op: list) -> str:
    """Carry out one operation; its outcome ("ok", "skipped", or the exception's type)."""
    from nanoserve.sampling_params import SamplingParams
    kind = op[0]
    if kind == "add":
        if len(engine.requests) >= MAX_LIVE or op[1] in engine.requests:
            return "skipped"
        engine.add_request(op[1], op[2], SamplingParams(**op[3]), priority=op[4])
    elif kind == "step":
        for _ in range(op[1]):
            if engine.has_unfinished_requests():
                engine.step()
    elif kind == "abort":
        rid = _picked(engine.requests, op[1])
        if rid is None:
            return "skipped"
        engine.abort_request(rid)
    elif kind == "abort_seq":
        sid = _picked([s for s, q in engine.sequences.items() if s != q.request_id], op[1])
        if sid is None:
            return "skipped"
        engine.abort_request(sid)
    elif kind == "fork":
        sid = _picked(engine.sequences, op[1])
        if sid is None:
            return "skipped"
        engine.fork(sid, seed=op[2])
    elif kind == "evict":
        if engine.radix is None:
            return "skipped"
        engine.radix.evict(op[1])
    elif kind == "drain":
        for _ in range(MAX_DRAIN_STEPS):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        if engine.has_unfinished_requests():
            return "did not drain"
        engine.clear_prefix_cache()
        pool = engine.pool
        if pool.num_used_blocks:
            return f"drained, prefix cache cleared, yet {pool.num_used_blocks} blocks still in use"
    else:
        raise ValueError(f"unknown operation {kind!r}")
    return "ok"


def visible(snapshot: dict) -> dict:
    """A snapshot without what names the code that ran (a student's module has another name)."""
    return {k: v for k, v in snapshot.items() if k not in ("implementation", "config", "model")}


def run_plan(plan: list[list], components=None, loaded=None, config: str = "recompute") -> dict:
    """`plan` applied to a fresh engine (config `config` of CONFIGS, the tiny Llama): {"config", "synced",
    "ops": [{"outcome", "events", "snapshot", "invariants"} per operation]}. An operation's exception is
    its outcome (`check_invariants` still runs after it); the run stops at the first broken invariant or the
    first exception other than a refusal (KeyError, ValueError: a bad target, no free seat)."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import LLMEngine
    from nanoserve.labs.capstone import untimed
    from nanoserve.models.loader import load_model
    from nanoserve.trace import event_to_dict

    loaded = loaded or load_model("tiny-llama")
    fields = dict(CONFIGS)[config]
    engine = LLMEngine(EngineConfig(model="tiny-llama", **fields), loaded=loaded, components=components)
    events: list[dict] = []
    engine.subscribe(lambda e: events.append(untimed(event_to_dict(e))))
    synced, ops = events[:], []
    events.clear()
    with engine:
        for op in plan:
            unexpected = False
            try:
                outcome = _apply(engine, op)
            except Exception as exc:   # noqa: BLE001 -- an outcome: refused (KeyError, ValueError), or a crash
                outcome = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                unexpected = not isinstance(exc, (KeyError, ValueError))
            try:
                engine.check_invariants()
                broken = ""
            except AssertionError as exc:
                broken = " ".join(str(exc).split())[:300] or "AssertionError"
            ops.append({"outcome": outcome, "events": events[:], "snapshot": visible(engine.snapshot()),
                        "invariants": broken})
            events.clear()
            if broken or unexpected:
                break
    return {"config": config, "synced": synced, "ops": ops}


def fuzz_json(folder: str, plan: list[list], config: str, without: list[str] | tuple = ()) -> str:
    """The worker's side: the judge's `plan` on the student's engine built from `folder` (but the parts in
    `without`), on the tiny Llama, as JSON text (plain data: the judge decides in its own process)."""
    import json

    from nanoserve.labs.capstone import _built, prepare
    prepare(folder, "tiny-llama", without)
    comps, loaded = _built[folder, "tiny-llama", tuple(without)]
    return json.dumps(run_plan(plan, comps, loaded, config))
