"""The distributed pictures and traces: `python docs/img/make_distributed_pictures.py`.

* tp-split.svg: how layer 0 of tiny-llama's weights and one request's KV are
  split over 2 ranks (nanoserve/viz/tp_dot.py, drawn from the real shards and
  a real request of a tensor-parallel engine);
* tui-tensor-parallel.svg / tui-disaggregated.svg: the TUI replaying a
  tensor-parallel run (the ranks bar) and the decode side of a disaggregated
  run (the KV handoffs);
* tests/data/tui-tensor-parallel.jsonl, tests/data/tui-disaggregated.jsonl:
  those two traces, which tests/test_distributed_view.py replays.

tests/test_distributed_view.py checks that the committed split picture has
every label the code draws today.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev
from nanoserve.models.loader import load_model
from nanoserve.trace import JsonlRecorder, read_trace

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
    from nanoserve.viz.tp_dot import split_dot

    loaded = load_model("tiny-llama")
    with LLMEngine(EngineConfig(**SPLIT_CONFIG), loaded=loaded) as engine:
        engine.add_request("q0", SPLIT_PROMPT, SamplingParams(max_tokens=8, temperature=0))
        for _ in range(SPLIT_STEPS):
            engine.step()
        request = engine.snapshot()["requests"][0]
    return split_dot(loaded.model, 2, request, block_size=SPLIT_CONFIG["block_size"],
                     num_blocks=SPLIT_CONFIG["num_blocks"])


def record_disaggregated(path: Path) -> None:
    """The decode side's events of a disaggregated run: three requests sharing a system prompt."""
    from nanoserve.distributed.disaggregated import DisaggregatedEngine

    config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=64, max_num_batched_tokens=32)
    with DisaggregatedEngine(config) as pair, JsonlRecorder(path) as recorder:
        pair.subscribe(recorder)
        for i, question in enumerate(["What is 2+2?", "Name a colour.", "Say hello."]):
            pair.add_request(f"q{i}", SYSTEM + question, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True))
            pair.step()
        while pair.has_unfinished_requests():
            pair.step()


def main() -> None:
    from nanoserve.scenarios import record
    from nanoserve.viz.graphviz import render
    from nanoserve_tui.screenshots import shoot, showcase_step

    SPLIT.write_bytes(render(split_source(), "svg"))
    record("tensor-parallel", TP_TRACE)
    step = showcase_step("tensor-parallel", read_trace(TP_TRACE))
    asyncio.run(shoot(TP_TRACE, step, (160, 50), IMG / "tui-tensor-parallel.svg", select="fork"))
    record_disaggregated(DISAGG_TRACE)
    arrived = [e.step for e in read_trace(DISAGG_TRACE) if isinstance(e, ev.KVTransferred)]
    asyncio.run(shoot(DISAGG_TRACE, arrived[1] + 1, (160, 50), IMG / "tui-disaggregated.svg"))
    print(f"wrote {SPLIT.name}, tui-tensor-parallel.svg (step {step}), tui-disaggregated.svg, and the traces")


if __name__ == "__main__":
    main()
