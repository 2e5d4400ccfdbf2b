"""Building an attention backend by name: the one place that knows every backend.

`attention.py` defines the interface (`AttentionBackend`) and the backends in
this package implement it; building them lives here, so the interface never
imports its implementations. Which name runs is implementation.py's choice.
"""

from __future__ import annotations

from nanoserve.attention import AttentionBackend


def make_backend(name: str, grouped: bool = True) -> AttentionBackend:
    """"torch" or "triton" (implementation.choose checks that Triton can run first). `grouped`: the torch
    backend attends decodes in groups of similar length (off on the reading path, kernels/torch_backend.py)."""
    if name == "triton":
        from nanoserve.kernels.triton_backend import TritonBackend
        return TritonBackend()
    if name == "torch":
        from nanoserve.kernels.torch_backend import TorchBackend
        return TorchBackend(grouped=grouped)
    raise ValueError(f"unknown attention backend {name!r}")
