"""The engine state machine, run long: tens of thousands of random operations over many configurations.

    OMP_NUM_THREADS=1 python benchmarks/fuzz_engine.py --ops 20000 --min-configs 40

It runs `EngineMachine` from tests/test_engine_stateful.py (CI runs a few dozen
examples of it) batch after batch of Hypothesis examples until at least `--ops`
operations have run over at least `--min-configs` distinct engine configurations.
Every operation is followed by `check_invariants()` and a comparison of a viewer's
fold with `engine.snapshot()`; every finished greedy request (and seeded one,
without speculation) is compared with the same request run alone on an engine with
every mechanism off. The operations include beam searches preempted by recompute
and swap, draft speculation with budgets of 1 and 2 tokens, single beams and forks
aborted, stop strings and stop ids with min_tokens, reused request ids, and injected
failures (a forward that raises, Ctrl-C, NaN logits, a raising subscriber).

It prints what happened (counts of every mechanism and check) and exits 1 on the
first failure, after Hypothesis has shrunk it to a short sequence of operations
(printed with the traceback). Batch i runs with Hypothesis seed `--seed` + i, so a
run is reproducible.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20_000, help="run at least this many operations")
    parser.add_argument("--min-configs", type=int, default=40, help="... over at least this many configurations")
    parser.add_argument("--steps", type=int, default=60, help="operations per example (at most)")
    parser.add_argument("--batch", type=int, default=25, help="examples per Hypothesis run")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the first batch (then +1 each)")
    parser.add_argument("--no-shrink", action="store_true", help="report a failure as found, unshrunk")
    args = parser.parse_args()

    import hypothesis.core
    import machine_reference as counts
    import test_engine_stateful as machine
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    phases = [Phase.generate] + ([] if args.no_shrink else [Phase.shrink])
    config = settings(max_examples=args.batch, stateful_step_count=args.steps, deadline=None, database=None,
                      derandomize=False, suppress_health_check=list(HealthCheck), phases=phases)
    t0, examples = time.perf_counter(), 0
    while counts.STATS["operations"] < args.ops or len(counts.CONFIGS) < args.min_configs:
        seed = args.seed + examples // args.batch
        hypothesis.core.global_force_seed = seed      # what pytest's --hypothesis-seed sets: reproducible
        try:
            run_state_machine_as_test(machine.EngineMachine, settings=config)
        except BaseException as exc:   # noqa: BLE001 -- print the (shrunk) failing sequence of operations
            traceback.print_exception(exc)
            print(f"\nFAILED in the batch with seed {seed}, after {counts.STATS['operations']} operations: "
                  f"{type(exc).__name__}: {exc}")
            return 1
        examples += args.batch
        print(f"  {counts.STATS['operations']:>6} operations, {len(counts.CONFIGS):>3} configurations, "
              f"{examples} examples, {time.perf_counter() - t0:.0f} s", flush=True)

    stats = counts.STATS
    print(f"\n{stats['operations']} operations (rules, each followed by check_invariants() and fold == snapshot) "
          f"in {examples} examples over {len(counts.CONFIGS)} engine configurations, "
          f"{time.perf_counter() - t0:.0f} s, no failure")
    print(f"{stats['outputs equal to the mechanisms-off engine']} finished greedy/seeded requests equal to the "
          "same request alone on an engine with every mechanism off")
    width = max(len(k) for k in stats)
    for key, count in sorted(stats.items()):
        print(f"  {key:<{width}}  {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
