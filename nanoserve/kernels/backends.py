"""Which attention backend runs, and building it: the one place that knows every backend.

`attention.py` defines the interface (`AttentionBackend`) and the backends in
this package implement it; choosing between them lives here, so the
interface never imports its implementations:

* `prepare_backend(config)`: "torch" or "triton" for an EngineConfig, after
  checking that Triton can run (installed; on a CPU, its interpreter on);
* `make_backend(name, fast_paths)`: the backend object the runner calls.
"""

from __future__ import annotations

import importlib.util
import os

from nanoserve.attention import AttentionBackend


def make_backend(name: str, fast_paths: bool = True) -> AttentionBackend:
    """"torch" or "triton" (see prepare_backend for the checks Triton needs first)."""
    if name == "triton":
        from nanoserve.kernels.triton_backend import TritonBackend
        return TritonBackend()
    if name == "torch":
        from nanoserve.kernels.torch_backend import TorchBackend
        return TorchBackend(fast=fast_paths)
    raise ValueError(f"unknown attention backend {name!r}")


def prepare_backend(config) -> str:
    """Pick the attention backend for an EngineConfig: "torch" or "triton".

    Triton on a CPU runs under its interpreter, which must be on before triton is imported.
    """
    backend = config.resolved_backend()
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' needs triton: pip install triton")
        if not config.device.startswith("cuda"):
            os.environ.setdefault("TRITON_INTERPRET", "1")
            import triton.language as tl

            # The interpreter must be on before triton is first imported (transformers imports it),
            # or triton's own helpers stay compiled-only.
            if type(tl.zeros).__name__ != "InterpretedFunction":
                raise ValueError("attention_backend='triton' on CPU runs under the Triton interpreter: "
                                 "start Python with TRITON_INTERPRET=1 in the environment")
    return backend
