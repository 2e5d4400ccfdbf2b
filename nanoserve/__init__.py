"""nanoserve: a small but complete LLM serving engine, built to be watched.

    from nanoserve import LLM, LLMEngine, EngineConfig, SamplingParams

`import nanoserve` never imports textual: the TUI is a separate package.
"""

from nanoserve.config import EngineConfig
from nanoserve.engine import LLMEngine
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput, StepResult
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "StepResult"]
__version__ = "0.1.0"
