"""How long the TUI takes to take in one step and repaint, on a big engine.

A synthetic trace: a 4096-block pool (block size 16) and 256 running
requests decoding one token each per step (~540 events per step: a chunk and
a token per request, plus a block whenever a request crosses a block
boundary). For each step we time, in a headless `run_test` app at 160x50:

    fold      the step's events into the ViewState
    update    the app's frame reactive -> every panel's watcher rebuilds its lines
    repaint   messages, layout, rendering the changed widgets (CPU time of `pilot.pause()`,
              which ends with the screen's update tick; its idle sleeps are not counted)

and print milliseconds per step against the 50 ms target (20 steps/s).

    python benchmarks/bench_tui.py [--steps 40] [--size 160x50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from nanoserve.events import (
    BlocksAllocated,
    ChunkScheduled,
    EngineSynced,
    Event,
    StepFinished,
    StepStarted,
    TokenSampled,
)
from nanoserve.trace import ViewState, fold
from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.source import Frame, ReplaySource

NUM_BLOCKS, BLOCK_SIZE, NUM_REQUESTS, PROMPT = 4096, 16, 256, 200
TARGET_MS = 50.0


def synced() -> EngineSynced:
    """256 running requests, each with a 200-token prompt already in the cache (13 blocks)."""
    per = -(-PROMPT // BLOCK_SIZE)
    ref_counts = [1] * (NUM_REQUESTS * per) + [0] * (NUM_BLOCKS - NUM_REQUESTS * per)
    requests = tuple(
        (f"r{i}", "running", "a prompt", PROMPT, "", 0, PROMPT, tuple(range(i * per, (i + 1) * per)), 64)
        for i in range(NUM_REQUESTS)
    )
    free = tuple(range(NUM_REQUESTS * per, NUM_BLOCKS))
    return EngineSynced(0, "synthetic", NUM_BLOCKS, BLOCK_SIZE, tuple(ref_counts), free, requests)


def step_events(state: ViewState, step: int) -> list[Event]:
    """One decode step for every running request, consistent with `state` (which it does not change)."""
    events: list[Event] = [StepStarted(step, 0, len(state.running))]
    free = iter(state.free_queue)
    for rid in state.running:
        req = state.sequences[rid]
        start = req.num_computed_tokens
        if start // BLOCK_SIZE >= len(req.block_table):   # the next token needs a fresh block
            events.append(BlocksAllocated(step, rid, (next(free),)))
        events.append(ChunkScheduled(step, rid, start, 1, False))
    for rid in state.running:
        events.append(TokenSampled(step, rid, 65 + step % 26, chr(65 + step % 26), -1.0))
    used = sum(1 for e in events if isinstance(e, BlocksAllocated))
    events.append(StepFinished(step, len(state.running), 0, len(state.running), len(state.free_queue) - used, 0.0))
    return events


async def run(steps: int, size: tuple[int, int]) -> dict[str, list[float]]:
    first = synced()
    app = NanoserveApp(ReplaySource([first], name="synthetic 4096 blocks x 256 requests"))
    times: dict[str, list[float]] = {"fold": [], "update": [], "repaint": [], "total": []}
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        state = fold(None, first)
        for step in range(1, steps + 1):
            events = step_events(state, step)
            t0 = time.perf_counter()
            for event in events:
                state = fold(state, event)
            t1 = time.perf_counter()
            app.frame = Frame(state, tuple(events))   # watchers: every panel rebuilds its lines
            t2 = time.perf_counter()
            # Pending messages, layout and rendering the changed widgets (pause ends with the
            # screen's update tick). CPU time, because pause also sleeps while it waits for idle.
            c0 = time.process_time()
            await pilot.pause()
            repaint = time.process_time() - c0
            if step > 3:                              # the first steps warm caches
                for key, value in zip(times, (t1 - t0, t2 - t1, repaint, t2 - t0 + repaint)):
                    times[key].append(value * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", default="160x50", help="terminal WIDTHxHEIGHT (default: %(default)s)")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    times = asyncio.run(run(args.steps, size))
    print(f"TUI step: {NUM_BLOCKS} blocks, {NUM_REQUESTS} requests, ~{2 * NUM_REQUESTS + 2} events/step, "
          f"{size[0]}x{size[1]}, {len(times['total'])} steps")
    for key, values in times.items():
        print(f"  {key:<8} median {statistics.median(values):6.1f} ms   max {max(values):6.1f} ms")
    median = statistics.median(times["total"])
    verdict = "within" if median <= TARGET_MS else "OVER"
    print(f"  => {median:.1f} ms per step, {median / TARGET_MS:.2f}x the {TARGET_MS:.0f} ms target ({verdict})")


if __name__ == "__main__":
    main()
