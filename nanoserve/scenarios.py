"""Scenarios: small, repeatable workloads that make one mechanism happen on screen.

A scenario is an engine config plus a list of requests, each arriving at a
given step, so continuous batching has something to do. `ScenarioRunner`
feeds the arrivals and steps the engine; `record()` writes the events of a
whole run to a JSONL trace that the TUI, the Graphviz exporter and the
lessons replay without a model.

    nanoserve record --scenario memory-pressure -o pressure.jsonl

They default to `tiny-llama` (instant, offline): a scenario is about the
engine's decisions, not the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.config import EngineConfig
from nanoserve.engine import LLMEngine
from nanoserve.sampling_params import SamplingParams
from nanoserve.trace import JsonlRecorder


@dataclass(slots=True)
class Arrival:
    step: int                  # added just before this step runs (0: before the first)
    request_id: str
    prompt: str | list[int]
    params: dict = field(default_factory=dict)   # SamplingParams fields


@dataclass(slots=True)
class Scenario:
    name: str
    description: str           # one line: what to watch for
    config: dict               # EngineConfig fields (model excluded)
    arrivals: list[Arrival]


SYSTEM = "You are a helpful assistant. Answer briefly and politely. "
TEXT = "The quick brown fox jumps over the lazy dog. "

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario(
        "continuous-batching",
        "Requests arrive while others decode; finished ones leave and free their seats at once.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4),
        [Arrival(0, "r1", "Hello there!", dict(max_tokens=12)),
         Arrival(0, "r2", "Paged attention", dict(max_tokens=6)),
         Arrival(2, "r3", "Continuous batching", dict(max_tokens=10)),
         Arrival(4, "r4", "Blocks and tables", dict(max_tokens=8)),
         Arrival(5, "r5", "One more request", dict(max_tokens=8)),
         Arrival(7, "r6", "Late arrival", dict(max_tokens=6))],
    ),
    Scenario(
        "memory-pressure",
        "A pool too small for everyone: the newest running request is preempted and recomputed later.",
        dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=6),
        [Arrival(0, f"r{i}", TEXT[: 10 + 4 * i], dict(max_tokens=16)) for i in range(5)],
    ),
    Scenario(
        "long-prompt",
        "Chunked prefill: a long prompt is computed over several steps while short requests keep decoding.",
        dict(block_size=8, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4),
        [Arrival(0, "short1", "Hi!", dict(max_tokens=16)),
         Arrival(0, "short2", "Hey", dict(max_tokens=16)),
         Arrival(1, "long", TEXT * 3, dict(max_tokens=6))],
    ),
    Scenario(
        "shared-system-prompt",
        "Requests share one system prompt: the radix tree keeps its blocks, later requests skip its prefill.",
        dict(block_size=8, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=4),
        [Arrival(i, f"q{i}", SYSTEM + q, dict(max_tokens=8))
         for i, q in enumerate(["What is 2+2?", "Name a colour.", "Say hello.", "Count to 3.", "Pick a fruit."])],
    ),
    Scenario(
        "parallel-sampling",
        "n=3 and a beam search fork one prompt: shared blocks (ref > 1), copy-on-write, pruned beams.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8),
        [Arrival(0, "sample", "Once upon a time", dict(n=3, max_tokens=10, temperature=1.0, seed=1)),
         Arrival(1, "beam", "The best answer is", dict(beam_width=3, n=3, temperature=0, max_tokens=8,
                                                       min_tokens=8))],
    ),
    Scenario(
        "swap-preemption",
        "A small pool with swap space: victims' KV moves to the CPU pool and back instead of being recomputed.",
        dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=6, preemption_mode="swap",
             num_cpu_blocks=16, enable_prefix_caching=False),
        [Arrival(0, f"r{i}", TEXT[: 10 + 4 * i], dict(max_tokens=16)) for i in range(5)],
    ),
    Scenario(
        "speculative-decoding",
        "N-gram drafts on repetitive text: several tokens accepted per step, rejected drafts' KV trimmed.",
        dict(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
             speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
        [Arrival(0, "repeat", list(range(40, 52)) * 3, dict(max_tokens=24, temperature=0)),
         Arrival(0, "other", [7, 8, 9, 7, 8, 9, 7], dict(max_tokens=16, temperature=0))],
    ),
    Scenario(
        "tensor-parallel",
        "Two processes share the model (a worker starts first): each rank's pool has the same block "
        "tables and its own KV heads; k switches rank.",
        dict(block_size=4, num_blocks=48, max_num_batched_tokens=32, max_num_seqs=6, tensor_parallel_size=2),
        [Arrival(0, "q0", SYSTEM + "What is 2+2?", dict(max_tokens=8)),
         Arrival(1, "q1", SYSTEM + "Name a colour.", dict(max_tokens=8)),
         Arrival(2, "fork", "Once upon a time,", dict(n=2, max_tokens=10, temperature=1.0, seed=1))],
    ),
]}


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


class ScenarioRunner:
    """Steps an engine through a scenario: adds each request at its step, then steps."""

    def __init__(self, scenario: Scenario, model: str = "tiny-llama", loaded=None) -> None:
        self.scenario = scenario
        self.engine = LLMEngine(EngineConfig(model=model, **scenario.config), loaded=loaded)
        self.pending = sorted(scenario.arrivals, key=lambda a: a.step)
        self.add_due()                     # the first arrivals wait in the queue before step 1

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def add_due(self) -> None:
        """Add the requests whose arrival step has come."""
        while self.pending and self.pending[0].step <= self.engine.step_count:
            a = self.pending.pop(0)
            params = {"ignore_eos": True, **a.params}   # random weights may emit EOS at once
            self.engine.add_request(a.request_id, a.prompt, SamplingParams(**params))

    def step(self):
        """Run one engine step, then add the requests due before the next; returns the StepResult."""
        result = self.engine.step()
        self.add_due()
        return result


def record(name: str, path: str | Path, model: str = "tiny-llama", max_steps: int = 1000) -> int:
    """Run scenario `name` to the end, writing every event to `path`; returns the number of steps."""
    runner = ScenarioRunner(get_scenario(name), model)
    with runner.engine, JsonlRecorder(path) as recorder:   # (the engine stops any worker processes at the end)
        runner.engine.subscribe(recorder)
        steps = 0
        while not runner.done and steps < max_steps:
            runner.step()
            steps += 1
    return steps
