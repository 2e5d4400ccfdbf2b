"""Lesson 11: events -> fold -> viewer. Write your own viewer in 30 lines.

Run it:  python lessons/11_write_a_viewer.py

Every decision the engine makes is published as a small plain-data event.
`fold(state, event)` applies one event to a view state, the way the engine
applied the decision to its own bookkeeping; the TUI, the Graphviz pictures
and the REPL panels are all drawn from that state, never from the engine's
internals. So a viewer is: subscribe, fold, draw. This lesson writes one in
under 30 lines, checks that the folded state equals the engine's own
`snapshot()` after every step, and replays a recorded trace through the same
viewer with no model at all.
"""

from nanoserve.lesson import breaks, console, say, section  # prose that fits your terminal; --break NAME

BROKEN = breaks({
    "skip-blocks-freed": "fold every event except BlocksFreed",
    "cached-is-free": "draw blocks that only the prefix cache holds as free",
})

import inspect  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.events import BlocksFreed, StepFinished  # noqa: E402
from nanoserve.trace import JsonlRecorder, fold, read_trace  # noqa: E402


class MiniViewer:
    """Fold every event into a view state; after each step, draw the pool and the queues on one line."""

    CELL = {"free": "·", "owned": "■", "shared": "▣", "cached": "□", "held": "?"}

    def __init__(self) -> None:
        self.state, self.lines = None, []

    def __call__(self, event) -> None:                 # engine.subscribe(viewer) calls this
        if BROKEN == "skip-blocks-freed" and isinstance(event, BlocksFreed):
            return
        self.state = fold(self.state, event)
        if isinstance(event, StepFinished):
            self.lines.append(self.draw())

    def draw(self) -> str:
        s = self.state
        kinds = s.block_kinds()                        # free / owned / shared / cached, per block
        if BROKEN == "cached-is-free":
            kinds = ["free" if k == "cached" else k for k in kinds]
        pool = "".join(self.CELL[k] for k in kinds)
        running = " ".join(f"{r}:{len(s.sequences[r].block_table)}" for r in s.running)
        free = kinds.count("free")
        return f"{s.step:3d} {pool} free {free:2d}  running {running or '-'}  waiting {' '.join(s.waiting) or '-'}"


source = inspect.getsource(MiniViewer)
assert len(source.splitlines()) <= 30, "the viewer fits in 30 lines"

# ---------------------------------------------------------------------------
section("1. Subscribe, fold, draw", f"""
MiniViewer, at the top of the script, is {len(source.splitlines())} lines. engine.subscribe(viewer) calls it with every event, starting with an EngineSynced that
carries the whole state, so a viewer may join at any time. Each StepFinished, it draws one line:
a cell per block (· free, ■ one request's, ▣ shared, □ cached only), the free count, the
running requests with their number of blocks, and the waiting queue.
""")
TEXT = "The quick brown fox jumps over the lazy dog. "
engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=24, max_num_batched_tokens=32))
viewer = MiniViewer()
engine.subscribe(viewer)
trace = Path(tempfile.mkdtemp()) / "run.jsonl"
recorder = JsonlRecorder(trace)
engine.subscribe(recorder)                          # a second subscriber: the trace on disk
late = None
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
for i in range(4):
    engine.add_request(f"r{i}", TEXT[: 12 + 6 * i], params)
while engine.has_unfinished_requests():
    if engine.step_count == 6:
        late = MiniViewer()
        engine.subscribe(late)                      # joins mid-run: starts from EngineSynced
    result = engine.step()
    snap = engine.snapshot()
    pool, folded = snap["pool"], viewer.state
    tables = {r["seq_id"]: r["block_table"] for r in snap["sequences"]}
    assert (folded.ref_counts, folded.free_queue) == (pool["ref_counts"], pool["free_queue"]), (
        f"after step {result.stats.step} the viewer's pool differs from the engine's: a viewer must fold every "
        "event, in order; BlocksFreed is what gives blocks back (ref counts down, released ones to the free "
        "queue), so a viewer that skips one keeps blocks the engine has freed")
    assert all(folded.sequences[r].block_table == t for r, t in tables.items()), "and the same block tables"
    assert viewer.lines[-1].split(" free ")[1].split()[0] == str(result.stats.num_free_blocks), (
        f"the viewer draws {viewer.lines[-1].split(' free ')[1].split()[0]} free blocks, the engine reports "
        f"{result.stats.num_free_blocks}: a block only the prefix cache holds is not free (its ref count is "
        "1, it is not in the free queue), it is cached: reusable by a hit, or evicted when memory runs short")
recorder.close()
for line in viewer.lines:
    console.print(line)
say(f"""After every one of the {len(viewer.lines)} steps the folded state had exactly the engine's ref counts,
free queue and block tables (asserted), though the viewer never looked at the engine.""")

# ---------------------------------------------------------------------------
section("2. A viewer that joins late, and a replay without a model", """
The late viewer subscribed after step 6: its first event was an EngineSynced with the whole
state, so from then on it draws what the first one draws. The trace on disk is the same
events as JSON lines; read back, they are equal objects, and the same viewer replays the run
with no model and no engine.
""")
assert late.lines == viewer.lines[6:], "a late viewer starts from EngineSynced and then agrees"
replay = MiniViewer()
events = read_trace(trace)
for event in events:
    replay(event)
assert replay.lines == viewer.lines, "the replay draws exactly what the live viewer drew"
console.print(f"late viewer: {len(late.lines)} lines, equal to the live viewer's last {len(late.lines)}")
console.print(f"replay of {trace.name}: {len(events)} events, {len(replay.lines)} lines, equal to the live ones")
say("""This is how the TUI works: a live engine and a recorded trace are two event sources for the
same fold and the same widgets (tui/source.py), which is why a recorded trace replays
anywhere, and why the tests can check the screen panel by panel from a trace.""")
console.print("All checks passed.", style="bold green")
