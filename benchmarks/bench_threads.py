"""A decode step's time on a busy machine: nanoserve's thread policy against one thread and torch's default.

    python benchmarks/bench_threads.py                      # SmolLM2-135M, one busy core beside us
    python benchmarks/bench_threads.py --load engine        # the load is a second engine, side by side
    python benchmarks/bench_threads.py --model tiny-llama   # any machine, seconds
    python benchmarks/bench_threads.py --teams --requests 1 --dtype bfloat16   # where the engine is built

torch starts one OpenMP thread per core. When another program keeps a core
busy, those threads wait for each other at every barrier while the core is
taken, and a step gets many times slower than with fewer threads. nanoserve's
thread policy (`nanoserve/threads.py`) samples how busy the cores are and
runs on the free ones.

For each condition (quiet, then loaded: `--burners` processes that each keep
one core busy, either spinning or running the same engine workload) the
script measures the median time of a decode step of `--requests` requests
with three thread counts, in the same process one after the other:

* torch's default (one thread per core),
* one thread,
* the policy's choice, sampled under that condition.

It prints milliseconds per step and each one's ratio to the policy. The
machine may be shared: compare ratios within one run, not across runs.

`--teams` measures something else on a quiet machine: which thread builds the
engine when another steps it (a server's engine thread). Each placement runs
in a fresh process, since OpenMP's teams live as long as the threads that
made them (`nanoserve/threads.py`): built and stepped on one thread; built on
the main thread, stepped on another (two teams: past the CPU count, libgomp's
workers sleep at every barrier); built on a thread that ends, stepped on
another (what `nanoserve serve` does). It prints milliseconds per step and
the voluntary context switches per step (the barrier sleeps).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import threading
import time

import torch

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_model
from nanoserve.threads import free_threads, on_a_thread_that_ends, usable_cores

PROMPT = "Write a long story about a dragon who learns to bake bread in a small village by the sea."


def decode_step_times(loaded, model: str, threads: int, requests: int, steps: int, engine=None) -> list[float]:
    """Seconds per decode step: `requests` requests past their prefill, `steps` steps timed."""
    torch.set_num_threads(threads)
    engine = engine or LLMEngine(EngineConfig(model=model, block_size=16, num_blocks=256), loaded=loaded)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(str(i), PROMPT, params)
    while any(s.is_prefilling for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()                                  # prefill: not what we time
    for _ in range(2):
        engine.step()                                  # warm up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def spin(stop) -> None:
    """Keep one core busy until told to stop."""
    while not stop.is_set():
        sum(range(10_000))


def engine_load(stop, model: str, requests: int) -> None:
    """Another engine on the same machine, with torch's default threads, decoding until told to stop."""
    loaded = load_model(model)
    while not stop.is_set():
        decode_step_times(loaded, model, torch.get_num_threads(), requests, 20)


def measure(loaded, args, label: str, default_threads: int) -> dict[str, float]:
    policy = free_threads()                            # sampled now, under this condition
    results = {}
    for name, threads in (("default", default_threads), ("one thread", 1), ("policy", policy)):
        times = decode_step_times(loaded, args.model, threads, args.requests, args.steps)
        results[name] = statistics.median(times)
        print(f"  {label:<8} {name:<11} {threads} thread{'s' if threads > 1 else ' '}  "
              f"{1000 * results[name]:8.1f} ms/step", flush=True)
    results["policy threads"] = policy
    return results


PLACEMENTS = ("one thread builds and steps", "main builds, another steps", "a thread that ends builds")


def placement_run(placement: str, args, out) -> None:
    """In a fresh process: build the engine where `placement` says, step it on another thread (or the same)."""
    build = lambda: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, block_size=16,  # noqa: E731
                                           num_blocks=256))
    result = {}

    def step(engine=None) -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        times = decode_step_times(None, args.model, torch.get_num_threads(), args.requests, args.steps,
                                  engine or build())
        result.update(ms=1000 * statistics.median(times),
                      sleeps=(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / len(times))

    engine = None
    if placement == PLACEMENTS[1]:
        engine = build()
    elif placement == PLACEMENTS[2]:
        engine = on_a_thread_that_ends(build)
    stepper = threading.Thread(target=step, args=(engine,))
    stepper.start()
    stepper.join()
    out.put(result)


def teams(args) -> None:
    ctx = mp.get_context("spawn")
    print(f"{args.model} {args.dtype}: decode step of {args.requests} request(s), median of {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}, {len(usable_cores())} usable cores; each row a fresh process")
    for placement in PLACEMENTS:
        out = ctx.Queue()
        proc = ctx.Process(target=placement_run, args=(placement, args, out))
        proc.start()
        r = out.get(timeout=600)
        proc.join()
        print(f"  {placement:<28} {r['ms']:7.2f} ms/step  {r['sleeps']:6.0f} voluntary context switches/step",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=4, help="requests decoding together (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per measurement (default 20)")
    parser.add_argument("--load", choices=["spin", "engine"], default="spin",
                        help="what keeps the cores busy: a spinning process, or a second engine (default spin)")
    parser.add_argument("--burners", type=int, default=1, help="busy processes (default 1)")
    parser.add_argument("--teams", action="store_true", help="where the engine is built (see above), quiet machine")
    parser.add_argument("--dtype", default="float32", help="--teams: the engine's dtype (default float32)")
    args = parser.parse_args()
    if args.teams:
        teams(args)
        return

    default_threads = torch.get_num_threads()          # torch's own choice at start: one per core
    loaded = load_model(args.model)
    print(f"{args.model}: decode step of {args.requests} requests, median of {args.steps} steps; "
          f"{len(usable_cores())} usable cores, torch default {default_threads} threads; load average "
          f"{os.getloadavg()[0]:.1f} before we start")
    quiet = measure(loaded, args, "quiet", default_threads)

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    target, extra = (spin, ()) if args.load == "spin" else (engine_load, (args.model, args.requests))
    burners = [ctx.Process(target=target, args=(stop, *extra), daemon=True) for _ in range(args.burners)]
    for p in burners:
        p.start()
    time.sleep(3 if args.load == "spin" else 20)       # an engine needs its model loaded first
    try:
        loaded_run = measure(loaded, args, "loaded", default_threads)
    finally:
        stop.set()
        for p in burners:
            p.join(timeout=30)

    print(f"\nwith {args.burners} {'spinning process' if args.load == 'spin' else 'engine'}"
          f"{'es' if args.burners > 1 and args.load == 'spin' else ''} beside it:")
    for condition, r in (("quiet", quiet), ("loaded", loaded_run)):
        base = r["policy"]
        print(f"  {condition:<7} policy ({r['policy threads']} thread{'s' if r['policy threads'] > 1 else ''}) "
              f"{1000 * base:.1f} ms/step; default {r['default'] / base:.2f}x, one thread "
              f"{r['one thread'] / base:.2f}x the policy's time")


if __name__ == "__main__":
    main()
