"""Regenerate the docs' TUI screenshots: `python -m nanoserve_tui.screenshots docs/img`.

For every scenario: record it on tiny-llama, replay the trace headless, stop
at the first step where the scenario's mechanism shows (a preemption, a
prefill chunk beside a decode, an accepted draft, a prefix hit, a
copy-on-write, a swap, ...), and save the app's
own SVG screenshot as `tui-<scenario>.svg`; plus `tui-100x30.svg`, the
memory-pressure screen at the small size.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from textual.widgets._footer import FooterKey

from nanoserve import events as ev
from nanoserve.scenarios import SCENARIOS, record
from nanoserve.trace import read_trace
from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.source import ReplaySource
from nanoserve_tui.widgets.pool import PoolGrid


def showcase_step(name: str, events: list) -> int:
    """The first step where scenario `name` shows its mechanism."""
    def first(pred) -> int:
        return next(e.step for e in events if pred(e))

    if name == "memory-pressure":
        preempted = [e.step for e in events if isinstance(e, ev.Preempted)]
        return preempted[0]
    if name == "long-prompt":
        decode_steps = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and not e.is_prefill}
        return first(lambda e: isinstance(e, ev.ChunkScheduled) and e.seq_id == "long"
                     and e.is_prefill and e.step in decode_steps)
    if name == "speculative-decoding":
        return first(lambda e: isinstance(e, ev.DraftVerified) and e.num_accepted > 0)
    if name == "shared-system-prompt":      # a later request reuses the system prompt's cached blocks
        return first(lambda e: isinstance(e, ev.PrefixMatched) and e.num_hit_tokens > 0 and e.step > 1)
    if name == "parallel-sampling":         # a sample writes into a shared block: copy-on-write
        return first(lambda e: isinstance(e, ev.CowCopied))
    if name == "swap-preemption":           # a victim's KV moves to the CPU pool
        return first(lambda e: isinstance(e, ev.SwappedOut))
    if name == "tensor-parallel":           # a fork's copy-on-write, replayed on both ranks
        return first(lambda e: isinstance(e, ev.CowCopied))
    if name == "structured-output":         # the last step in which three grammars mask together
        steps = [e.step for e in events if isinstance(e, ev.TokenConstrained)]
        return max((step for step in steps if steps.count(step) >= 3), default=steps[0])
    # continuous-batching: the step in which a request is admitted after another finished
    finished = first(lambda e: isinstance(e, ev.SequenceFinished))
    return first(lambda e: isinstance(e, ev.SequenceAdmitted) and e.step > finished)


async def shoot(trace: Path, step: int, size: tuple[int, int], out: Path, select: str | None = None) -> None:
    """Save the screen at `step`; `select`: show the details of this request's last block."""
    source = ReplaySource.from_path(trace)
    source.position = next(i for i, group in enumerate(source.groups)
                           if any(isinstance(e, ev.StepStarted) and e.step == step for e in group))
    app = NanoserveApp(source)
    async with app.run_test(size=size) as pilot:
        while app.frame is None or app.frame.state.step != step:
            await pilot.pause(0.05)
        if select is not None:
            app.query_one(PoolGrid).selected = app.frame.state.sequences[select].block_table[-1]
        await pilot.pause(0.2)
        for _ in range(100):          # the footer fills its keys in a later refresh (slower on a busy machine)
            if app.query(FooterKey):
                break
            await pilot.pause(0.1)
        await pilot.pause(0.1)
        out.write_text(app.export_screenshot(title=f"nanoserve tui --replay {trace.name}  (step {step})"))


def main(folder: str = "docs/img") -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in SCENARIOS:
            trace = Path(tmp) / f"{name}.jsonl"
            record(name, trace)
            step = showcase_step(name, read_trace(trace))
            select = {"memory-pressure": "r0", "tensor-parallel": "fork"}.get(name)
            asyncio.run(shoot(trace, step, (160, 50), out / f"tui-{name}.svg", select))
            if name == "memory-pressure":
                asyncio.run(shoot(trace, step, (100, 30), out / "tui-100x30.svg", select))
            print(f"tui-{name}.svg: step {step}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
