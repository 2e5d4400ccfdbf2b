"""A trace as one self-contained web page: the TUI's own screen at every step, behind a slider.

    nanoserve export --trace pressure.jsonl --format html -o replay.html

Each frame is exactly what `nanoserve tui --replay pressure.jsonl` draws at
that step: the app runs headless (`App.run_test`, Textual's own test driver)
on the trace's `ReplaySource`, goes to each step and saves Textual's SVG
screenshot of its screen. Nothing of the engine is drawn a second time; the
page's script only decompresses a frame and puts it on the page.

The file needs no network and no Python: it opens from `file://`. Every
frame is gzipped (a 160x50 screen is ~170 kB of SVG, ~11 kB gzipped) and
base64-encoded into one JSON block; the browser's own `DecompressionStream`
unpacks the frame on show. The fonts the SVG would fetch from a CDN are
dropped (the page's monospace font draws it).

Size budget: BUDGET_BYTES (5 MB) for the whole file, which a 50-step trace
meets many times over (about 0.8 MB). A longer trace is sampled: at most
MAX_FRAMES steps, evenly spaced, always with the first and the last, and
thinned again if the frames still do not fit; the caller is told which.
The page template is `replay.html` beside this module; the slider, the arrow
keys and play/pause are its few lines of JavaScript.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.source import ReplaySource, replay_source

BUDGET_BYTES = 5_000_000        # the whole page, frames included
MAX_FRAMES = 250                # steps rendered at most (~15 kB each once encoded: ~3.8 MB)
SIZE = (160, 50)                # the terminal the frames are drawn at: the docs' screenshots' size
TEMPLATE = Path(__file__).with_name("replay.html")

# Textual's SVG asks a CDN for Fira Code; a page that must work offline keeps only `local(...)`.
_FONT_URL = re.compile(r',\s*url\("https?://[^"]*"\)\s*format\("[^"]*"\)')


@dataclass(frozen=True, slots=True)
class Replay:
    """What was written: the path, its size, and which of the trace's steps it shows."""

    path: Path
    size: int                   # bytes
    steps: tuple[int, ...]      # the engine step of every frame, in order
    total_steps: int            # the trace's step groups (prelude included): steps == total when not sampled

    @property
    def sampled(self) -> bool:
        return len(self.steps) < self.total_steps


def pick(total: int, limit: int, keep: int | None = None) -> list[int]:
    """`limit` indices out of range(total), evenly spaced, with the first, the last and `keep`."""
    if total <= limit:
        return list(range(total))
    chosen = {round(i * (total - 1) / (limit - 1)) for i in range(limit)}
    if keep is not None:
        chosen.add(keep)
    return sorted(chosen)


def offline_svg(svg: str) -> str:
    return _FONT_URL.sub("", svg)


def pack(svg: str) -> str:
    """One frame as the page stores it: gzip (mtime 0: the same screen gives the same bytes), base64."""
    return base64.b64encode(gzip.compress(offline_svg(svg).encode(), 9, mtime=0)).decode()


def unpack(frame: str) -> str:
    """The SVG of one stored frame (tests and the docs' drift check read frames back with it)."""
    return gzip.decompress(base64.b64decode(frame)).decode()


async def render_frames(source: ReplaySource, indices: list[int], size: tuple[int, int] = SIZE) -> list[str]:
    """The TUI's SVG screenshot after each step group in `indices` (indices into `source.groups`)."""
    from textual.widgets._footer import FooterKey

    app = NanoserveApp(source)
    frames = []
    async with app.run_test(size=size) as pilot:
        for _ in range(200):        # the key bar fills in a refresh after the panels (slower on a busy machine)
            if app.frame is not None and app.query(FooterKey):
                break
            await pilot.pause(0.05)
        for index in indices:
            source.goto(index)
            while app.frame is not source.frame(index):   # FrameReady handled: every panel has its state
                await pilot.pause()
            await pilot.pause()
            step = source.frame(index).state.step
            frames.append(app.export_screenshot(title=f"nanoserve tui --replay {source.description}  (step {step})"))
    return frames


def page(name: str, steps: list[int], last_step: int, frames: list[str], start: int, note: str) -> str:
    """The HTML: the template with the frames' JSON in place."""
    data = {"trace": name, "steps": steps, "last_step": last_step, "start": start, "note": note, "frames": frames}
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")   # nothing can close the <script>
    html = TEMPLATE.read_text()
    return html.replace("{{title}}", _escape(f"nanoserve replay: {name}")).replace("{{data}}", blob)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def export_html(trace: str | Path, output: str | Path | None = None, step: int | None = None,
                max_frames: int = MAX_FRAMES, budget: int = BUDGET_BYTES, size: tuple[int, int] = SIZE) -> Replay:
    """Write the replay page of `trace`; it opens at `step` (default: the first).

    A missing or corrupt trace raises FileNotFoundError / ValueError before anything is written
    (the TUI's own check, `replay_source`)."""
    trace = Path(trace)
    source = replay_source(trace)
    steps_of = source.steps()
    start = 0
    if step is not None:
        if step not in steps_of:
            raise ValueError(f"--step {step}: the trace has steps {steps_of[0]}..{steps_of[-1]}")
        start = steps_of.index(step)
    indices = pick(len(source.groups), max_frames, start)
    frames = [pack(svg) for svg in asyncio.run(render_frames(source, indices, size))]
    overhead = len(page(source.description, [], 0, [], 0, ""))
    while overhead + sum(len(f) + 3 for f in frames) > budget and len(frames) > 2:   # still too big: thin
        keep = pick(len(frames), max(2, len(frames) * 3 // 4), indices.index(start) if start in indices else None)
        indices, frames = [indices[k] for k in keep], [frames[k] for k in keep]
    shown = [steps_of[i] for i in indices]
    note = "" if len(indices) == len(source.groups) else (
        f"{len(indices)} of the trace's {len(source.groups)} steps, evenly spaced (the page's size budget)")
    html = page(source.description, shown, source.final_step, frames,
                indices.index(start) if start in indices else 0, note)
    out = Path(output) if output is not None else trace.with_name(f"{trace.stem}-replay.html")
    out.write_text(html)
    return Replay(out, len(html.encode()), tuple(shown), len(source.groups))
