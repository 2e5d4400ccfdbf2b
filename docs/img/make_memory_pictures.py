"""Regenerate the memory pictures of the docs: `python docs/img/make_memory_pictures.py`.

Each picture is the Graphviz exporter (`nanoserve.viz.graphviz`) drawing the
view state of a real run, at the step the page talks about. The runs are the
lessons' workloads (lessons/04-06), on `tiny-llama`, so the block ids in the
pictures are the ones the lessons print. The view state is folded from the
engine's events as they happen (`engine.subscribe`), exactly as the TUI and a
recorded trace see it, so a step's hits, new tree nodes and touched blocks are
marked. Needs Graphviz's `dot` program.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.events import StepFinished
from nanoserve.trace import fold
from nanoserve.viz.graphviz import dot_program, pool_dot, radix_dot, render, tables_dot

HERE = Path(__file__).resolve().parent
BUILDERS = {"tables": tables_dot, "pool": pool_dot, "radix": radix_dot}


class Camera:
    """Folds an engine's events into a view state; after step s, draws what `shots[s]` asks for."""

    def __init__(self, engine: LLMEngine, shots: dict[int, list[tuple[str, str]]]) -> None:
        self.state, self.shots, self.sources = None, shots, {}
        engine.subscribe(self.on_event)

    def on_event(self, event) -> None:
        self.state = fold(self.state, event)
        if isinstance(event, StepFinished):
            for what, name in self.shots.get(event.step, []):
                self.sources[name] = BUILDERS[what](self.state)   # DOT source of the state now

    def pictures(self) -> dict[str, str]:
        """Name -> DOT source; fails if the run ended before a requested step."""
        missing = {name for shots in self.shots.values() for _, name in shots} - set(self.sources)
        assert not missing, f"the run ended before these pictures' steps: {sorted(missing)}"
        return self.sources


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple[str, object, SamplingParams]]]) -> None:
    """Add each request before its step (arrivals[step]), then step to the end."""
    while any(s > engine.step_count for s in arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(engine.step_count + 1, []):
            engine.add_request(rid, prompt, params)
        engine.step()


def prefix_cache() -> dict[str, str]:
    """Lesson 4: one system prompt, a question per step; step 5 has all five running."""
    system = "You are a helpful assistant. Answer briefly and politely. "
    questions = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to 3.", "Pick a fruit."]
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=8, num_blocks=96, max_num_batched_tokens=128))
    camera = Camera(engine, {5: [("radix", "radix-shared-system-prompt"), ("pool", "pool-shared-system-prompt")],
                             12: [("radix", "radix-after-requests")]})
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    drive(engine, {i + 1: [(f"q{i}", system + q, params)] for i, q in enumerate(questions)})
    return camera.pictures()


def fork() -> dict[str, str]:
    """Lesson 5: n=4 right after the copy-on-write step, and beam search mid-search."""
    prompt = "Once upon a time, in a land far"
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64, enable_prefix_caching=False))
    camera = Camera(engine, {2: [("tables", "tables-n4-fork")]})
    drive(engine, {1: [("p", prompt, SamplingParams(n=4, max_tokens=8, temperature=0, ignore_eos=True))]})
    beams = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64, enable_prefix_caching=False))
    beam_camera = Camera(beams, {4: [("tables", "tables-beam-search")]})
    drive(beams, {1: [("b", prompt, SamplingParams(beam_width=3, n=3, temperature=0, max_tokens=6, min_tokens=6))]})
    return {**camera.pictures(), **beam_camera.pictures()}


def preemption() -> dict[str, str]:
    """Lesson 6: the step where the first victim is swapped out, and the recompute run's same step."""
    text = "The quick brown fox jumps over the lazy dog. "
    sources = {}
    for mode in ("swap", "recompute"):
        engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=20, max_num_batched_tokens=32,
                                        enable_prefix_caching=False, preemption_mode=mode))
        shots = {5: [("pool", f"pool-{mode}"), ("tables", f"tables-{mode}")]} if mode == "swap" else \
            {5: [("tables", f"tables-{mode}")]}
        camera = Camera(engine, shots)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        drive(engine, {1: [(f"r{i}", text[: 10 + 4 * i], params) for i in range(5)]})
        sources.update(camera.pictures())
    return sources


def main(folder: Path = HERE) -> None:
    if dot_program() is None:
        sys.exit("Graphviz's `dot` is not installed (apt-get install graphviz, or brew install graphviz)")
    for make in (prefix_cache, fork, preemption):
        for name, source in make().items():
            path = folder / f"{name}.svg"
            path.write_bytes(render(source, "svg"))
            print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    main()
