"""The distributed pictures' workloads, and the traces: `python docs/img/make_distributed_pictures.py`.

* `split_source()`: the DOT of tp-split.svg, how layer 0 of tiny-llama's
  weights and one request's KV are split over 2 ranks (nanoserve/viz/tp_dot.py,
  drawn from the real shards and a real request of a tensor-parallel engine);
* `record_disaggregated()`: the decode side's events of a disaggregated run,
  which tui-disaggregated.svg shows.

`python docs/generate.py distributed` draws both pictures (and
tests/test_docs.py checks them against a fresh run); the tensor-parallel TUI
screenshot is the `screens` job's. Run as a script, this file writes
tests/data/tui-tensor-parallel.jsonl and tests/data/tui-disaggregated.jsonl,
the traces tests/test_distributed_view.py replays.
"""

from __future__ import annotations

from pathlib import Path

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_model
from nanoserve.trace import JsonlRecorder

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
DATA = ROOT / "tests" / "data"
SPLIT = IMG / "tp-split.svg"
TP_TRACE = DATA / "tui-tensor-parallel.jsonl"
DISAGG_TRACE = DATA / "tui-disaggregated.jsonl"
SYSTEM = "You are a helpful assistant. Answer briefly. "

# The split picture: tiny-llama over 2 ranks, the first request of this run after SPLIT_STEPS steps.
SPLIT_CONFIG = dict(model="tiny-llama", block_size=4, num_blocks=48, tensor_parallel_size=2)
SPLIT_PROMPT, SPLIT_STEPS = "The KV cache, split by heads.", 3


def split_source() -> str:
    """The DOT source of tp-split.svg, from a real tensor-parallel engine's request."""
    from nanoserve.distributed.sharding import split_plan
    from nanoserve.viz.tp_dot import split_dot

    loaded = load_model("tiny-llama")
    with LLMEngine(EngineConfig(**SPLIT_CONFIG), loaded=loaded) as engine:
        engine.add_request("q0", SPLIT_PROMPT, SamplingParams(max_tokens=8, temperature=0))
        for _ in range(SPLIT_STEPS):
            engine.step()
        request = engine.snapshot()["sequences"][0]
    return split_dot(split_plan(loaded.model, 2), request, block_size=SPLIT_CONFIG["block_size"],
                     num_blocks=SPLIT_CONFIG["num_blocks"])


def record_disaggregated(out: Path, model: str = "tiny-llama", system: str = SYSTEM, form: str = "{}",
                         **settings) -> None:
    """The decode side's events of a disaggregated run: three requests sharing a system prompt.

    tests/data's trace is tiny-llama's (instant); the docs' screenshot runs SmolLM2 on the reading path
    (`model="smollm2", path="reading"`), with prompts it answers in words (`system`, each question in
    `form`), so a learner reads the questions and the answers."""
    from nanoserve.distributed.disaggregated import DisaggregatedEngine

    config = EngineConfig(model=model, block_size=4, num_blocks=64, max_num_batched_tokens=32, **settings)
    with DisaggregatedEngine(config) as pair, JsonlRecorder(out) as recorder:
        pair.subscribe(recorder)
        for i, question in enumerate(["What is 2+2?", "Name a colour.", "Say hello."]):
            pair.add_request(f"q{i}", system + form.format(question), SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True))
            pair.step()
        while pair.has_unfinished_requests():
            pair.step()


def main() -> None:
    """Write the two traces tests/test_distributed_view.py replays (the pictures: docs/generate.py)."""
    from nanoserve.scenarios import record

    record("tensor-parallel", TP_TRACE)
    record_disaggregated(DISAGG_TRACE)
    print(f"wrote {TP_TRACE.relative_to(ROOT)} and {DISAGG_TRACE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
