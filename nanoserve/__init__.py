"""nanoserve: a small but complete LLM serving engine, built to be watched.

    from nanoserve import LLM, LLMEngine, EngineConfig, SamplingParams

`import nanoserve` never imports textual: the TUI is a separate package. It
does not import torch either until a name that needs it is used (PEP 562
module `__getattr__`), so `nanoserve --help`, error messages and replaying a
trace start in a fraction of a second.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "EngineConfig": "nanoserve.config",
    "LLMEngine": "nanoserve.engine",
    "Components": "nanoserve.components",
    "LLM": "nanoserve.llm",
    "CompletionOutput": "nanoserve.outputs",
    "RequestOutput": "nanoserve.outputs",
    "StepResult": "nanoserve.outputs",
    "SamplingParams": "nanoserve.sampling_params",
}

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "Components", "RequestOutput", "CompletionOutput", "StepResult"]


def _version() -> str:
    """The installed distribution's version: pyproject.toml's, the one version string of the project.
    A source tree that was never installed has no metadata: "0+unknown" says so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanoserve")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    """Import the module defining `name` on first use, then keep the name here (`__version__`: read
    from the installed metadata on first use)."""
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
