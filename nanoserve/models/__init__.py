"""Model implementations (GPT-2, Llama and its family) over the paged KV cache, and their loader.

gpt2.py     GPT-2: learned positions, fused q/k/v, attention through paged_attention
llama.py    Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU (SmolLM2 is one); sliding windows
qwen2.py    Qwen2/Qwen2.5: Llama with biases on q, k, v
qwen3.py    Qwen3: Llama with QK-norm (an RMSNorm per query and key head)
gemma3.py   Gemma 3 (text): (1 + w) norms before and after, scaled embeddings, local and global layers
resolve.py  model names to directories (no torch import: the CLI's errors stay fast)
loader.py   load_model: our model with the weights of a transformers model
default.py  the model a command runs when none is named (SmolLM2 when installed)
first_load.py  a GGUF file's one-time conversion, shown as it goes (tqdm, the TUI)
"""

from __future__ import annotations

import importlib

__all__ = ["LoadedModel", "load_model"]


def __getattr__(name: str):
    """`from nanoserve.models import load_model` imports torch only when asked."""
    if name in __all__:
        return getattr(importlib.import_module("nanoserve.models.loader"), name)
    raise AttributeError(f"module 'nanoserve.models' has no attribute {name!r}")
