"""Driving the real engine with a student's component, and comparing it with the engine's own.

`run_engine` builds an `LLMEngine` from `Components`, adds requests, steps
until every request is done (or a step limit: a scheduler that makes no
progress is a livelock, not a slow run) and checks every invariant after
every step: the engine's `check_invariants()` *and* the reference
implementations' checks applied to the student's objects, so a student's
file cannot pass by editing its own `check_invariants`.

`same_as_engine` runs one workload twice, with the student's component and
with the engine's own, and compares every completion token by token. The
engine's own outputs are the reference because the test suite holds them
equal to Hugging Face `generate` on the same weights (tests/test_parity.py).
"""

from __future__ import annotations

from collections import Counter

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.kv_groups import live
from nanoserve.labs.lab import CheckFailed, Context
from nanoserve.radix_cache import RadixCache

TINY = dict(model="tiny-llama", block_size=4, max_num_batched_tokens=32)


def reference_invariants(engine) -> None:
    """The engine's invariants, checked by the engine's own code on whatever objects the engine holds."""
    running = engine.scheduler.running
    tables = [live(t) for s in running for t in [s.block_table, *s.group_tables]]   # every KV cache group's
    if engine.radix is not None:
        tables += RadixCache.held_blocks(engine.radix) + engine.scheduler.kv.group_cache.held()
        locks = Counter(s.cache_node.node_id for s in running if s.cache_node is not None)
        RadixCache.check_invariants(engine.radix, dict(locks))
    BlockPool.check_invariants(engine.pool, tables)
    engine.check_invariants()


def run_engine(ctx: Context, components: Components, requests: list[tuple], config: dict | None = None,
               max_steps: int = 400, fork_at: dict[str, int] | None = None, on_step=None):
    """Run `requests` [(id, prompt token ids, SamplingParams)] to the end; returns (engine, outputs).

    outputs maps request id -> list of completions' token ids (index order). `fork_at` forks
    request id at the given step. `on_step(engine, result, before)` is called after every step,
    with `before` the engine's snapshot just before it (a check's own per-step property).
    """
    from nanoserve.config import EngineConfig
    from nanoserve.engine import LLMEngine

    cfg = {**TINY, **(config or {})}
    engine = LLMEngine(EngineConfig(**cfg), loaded=ctx.loaded(cfg["model"]), components=components)
    for rid, prompt, params, *priority in requests:     # (an optional 4th item: the request's priority)
        engine.add_request(rid, prompt, params, priority=priority[0] if priority else 0)
    reference_invariants(engine)
    outputs: dict[str, list[list[int]]] = {}
    for step in range(1, max_steps + 1):
        if not engine.has_unfinished_requests():
            break
        before = engine.snapshot() if on_step else None
        try:
            result = engine.step()
        except Exception as exc:      # noqa: BLE001 -- said in the check's words when the engine's code raised
            raise engine_failure(exc, ctx.path, step) or exc
        reference_invariants(engine)
        if on_step:
            on_step(engine, result, before)
        for out in result.outputs:
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        for rid, at in (fork_at or {}).items():
            if at == step and rid in engine.sequences:
                engine.fork(rid)
                reference_invariants(engine)
    else:
        raise CheckFailed(f"requests still unfinished after {max_steps} steps: the engine stopped making progress",
                          "a livelock: the same requests are scheduled and undone every step")
    return engine, outputs


def engine_failure(exc: BaseException, path: str, step: int) -> CheckFailed | None:
    """A step that raised in the engine's own code (not in the student's file, at `path`), in the check's
    words: the state the student's component left is one the engine cannot go on from. None when the
    student's file is on the way (then its line is the one to fix, and the row names it)."""
    from pathlib import Path

    from nanoserve.labs.load import frames_of

    target = str(Path(path).resolve())
    chain, seen, root = exc, set(), exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if any(_resolved(f[0]) == target for f in frames_of(chain)):
            return None
        root = chain
        chain = chain.__cause__ or chain.__context__
    frames = frames_of(root)
    where = f" in the engine's {frames[-1][2]}" if frames else ""
    text = " ".join(f"{type(root).__name__}: {root}".split())[:200]
    return CheckFailed(f"at step {step} the engine could not go on from the state your component left "
                       f"({text}{where})")


def _resolved(filename: str) -> str:
    from pathlib import Path
    try:
        return str(Path(filename).resolve())
    except (OSError, RuntimeError, ValueError):
        return filename


def same_as_engine(ctx: Context, requests: list[tuple], config: dict | None = None, hint: str | None = None,
                   fork_at: dict[str, int] | None = None):
    """Run with the student's component and with the engine's own; CheckFailed at the first different token."""
    _, want = run_engine(ctx, Components(), requests, config, fork_at=fork_at)
    engine, got = run_engine(ctx, ctx.components(), requests, config, fork_at=fork_at)
    for rid in want:
        if got.get(rid) != want[rid]:
            w, g = want[rid], got.get(rid)
            raise CheckFailed(f"request {rid}: got tokens {g}, the engine's own component gives {w}", hint)
    return engine


def prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """`n` token-id prompts of `length` tokens, the first `shared` of them common to all (a system prompt)."""
    import random
    rng = random.Random(seed)
    head = [rng.randrange(3, 200) for _ in range(shared)]
    return [head + [rng.randrange(3, 200) for _ in range(length - shared)] for _ in range(n)]
