"""Which code computes a step: decided once per runner, in one place, and said in one line.

Three settings ask, and `choose()` answers them all, turning "auto" into names:

    EngineConfig.path               "fast" (the default): on a CPU, nanoserve/cpu/ with its C files where
                                    they build; "torch": the same fast path without the C files;
                                    "reading": models/ and kernels/reference.py only. The same tokens.
    EngineConfig.attention_backend  "auto": "triton" on CUDA (when installed), "cpu" (the C kernel) on a
                                    CPU on the "fast" path, else "torch"
    EngineConfig.enforce_eager      CUDA graphs for pure-decode steps (cuda_graphs.py)

`build()` then builds what was chosen and returns it with its `Implementation`,
the line the engine reports (snapshot, EngineSynced, the TUI header, `--stats`)
and logs once. A part that cannot be built here (no C compiler, a cache dtype
the C kernel does not read) falls back alone, and the line says why. A lab's
attention backend (components.py) always runs as given.

A test forces a path for every runner built inside `forced_path(...)`
(tests/test_implementation.py), the way nanochat's flash_attention.py lets a
test force its kernel. Only this module imports nanoserve/cpu/
(tests/test_import_graph.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from nanoserve import cpu
from nanoserve.attention import AttentionBackend
from nanoserve.config import PATHS
from nanoserve.cuda_graphs import GraphSettings, buckets
from nanoserve.kernels.backends import make_backend
from nanoserve.kernels.torch_backend import TorchBackend

log = logging.getLogger("nanoserve")

_forced_path: str | None = None   # set by forced_path(): every runner built meanwhile runs this path


@contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Tests: every runner built inside the block runs `path` ("fast", "torch" or "reading"), whatever its config."""
    global _forced_path
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    before, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = before


@dataclass(frozen=True, slots=True)
class Choice:
    """The names `choose()` turned "auto" into; `build()` builds them."""

    path: str = "fast"                  # "fast", "torch" or "reading" (EngineConfig.path)
    attention: str = "torch"            # "torch", "triton" or "cpu" (the C kernel)
    graphs: GraphSettings | None = None  # None: every step runs eagerly


def choose(config) -> Choice:
    """An EngineConfig's "auto"s as names; Triton is checked here (installed; on a CPU, its interpreter on)."""
    path = _forced_path or config.path
    on_cpu = config.device == "cpu"
    attention = config.attention_backend
    if attention == "auto":
        cuda_triton = config.device.startswith("cuda") and importlib.util.find_spec("triton") is not None
        attention = "triton" if cuda_triton else "cpu" if on_cpu and path == "fast" else "torch"
    elif attention == "cpu" and path != "fast":   # a forced slower path: no C kernel
        attention = "torch"
    if attention == "triton":
        _check_triton(config.device)
    return Choice(path, attention, GraphSettings.from_config(config))


def _check_triton(device: str) -> None:
    """Triton must be installed; on a CPU it runs under its interpreter, which must be on before it is imported."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend='triton' needs triton: pip install triton")
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton.language as tl

        # The interpreter must be on before triton is first imported (transformers imports it),
        # or triton's own helpers stay compiled-only.
        if type(tl.zeros).__name__ != "InterpretedFunction":
            raise ValueError("attention_backend='triton' on CPU runs under the Triton interpreter: "
                             "start Python with TRITON_INTERPRET=1 in the environment")


@dataclass(frozen=True, slots=True)
class Implementation:
    """What computes a step, as it actually ran: the engine reports it (snapshot, EngineSynced, TUI, --stats)."""

    path: str          # "fast", "torch" (the fast path without C files) or "reading" (models/, kernels/reference.py)
    model: str         # the model class that runs, and its file (and what of it runs as one C call)
    attention: str     # the attention backend that runs (AttentionBackend.label)
    matmul: str        # what multiplies the linear layers
    note: str = ""     # why a faster part did not run, e.g. "attention.c not built: no C compiler found ..."
    graphs: str = ""   # "CUDA graphs for batches of 1-32", "padded to 1-32, uncaptured", or "" (eager)

    def summary(self) -> str:
        """One line: "fast path: CpuLlama (cpu/llama.py) · attention cpu (cpu/attention.c) · matmul ..."."""
        line = f"{self.path} path: {self.model} · attention {self.attention} · matmul {self.matmul}"
        line += f" · {self.graphs}" if self.graphs else ""
        return line + (f" ({self.note})" if self.note else "")

    def as_dict(self) -> dict[str, str]:
        """The fields, `graphs` only when set (a trace of an eager engine reads as before graphs were named)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "graphs" or v}


@dataclass(slots=True)
class Built:
    """The parts `build()` chose, as the runner uses them."""

    model: nn.Module               # the loaded model, or the CPU fast path's view of it
    attention: AttentionBackend
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]   # allocates the KV cache
    implementation: Implementation


def build(model: nn.Module, dtype: torch.dtype, device: torch.device, choice: Choice,
          make_attention: Callable[[str, bool], AttentionBackend] = make_backend) -> Built:
    """The model view, attention backend and cache allocator `choice` names, and the line that says so (logged).

    `make_attention(name, grouped)` builds "torch" and "triton" (components.py: a lab may replace it, and then
    its backend runs on every path); `grouped` is False on the reading path (kernels/torch_backend.py)."""
    path = _forced_path or choice.path
    own = make_attention is make_backend
    name = "torch" if choice.attention == "cpu" else choice.attention
    attention, zeros, matmul, note, label = None, partial(_zeros, device=device), "torch (nn.Linear)", "", ""
    if path != "reading" and device.type == "cpu":    # the CPU fast path, all of it in nanoserve/cpu/
        fast = cpu.fast_path(model, dtype, c_files=path == "fast", c_attention=own and choice.attention == "cpu")
        model, zeros, matmul, note, label = fast.model, fast.zeros, fast.matmul, fast.note, fast.label
        attention = fast.attention                     # the C kernel, when chosen and built
        if attention is None and own and name == "torch" and fast.upcast:
            attention = TorchBackend(grouped=True, compute_dtype=torch.float32)   # bf16 K/V, float32 math
    if attention is None:
        attention = make_attention(name, path != "reading")
    implementation = Implementation(path, label or where(model), attention.label, matmul, note,
                                    _graphs(choice.graphs))
    log.info("nanoserve: %s", implementation.summary())
    return Built(model, attention, zeros, implementation)


def _graphs(graphs: GraphSettings | None) -> str:
    if graphs is None:
        return ""
    sizes = buckets(graphs.max_num_seqs)
    what = "CUDA graphs for" if graphs.capture else "decodes padded, uncaptured, to"
    return f"{what} batches of {sizes[0]}-{sizes[-1]}"


def where(obj: object) -> str:
    """A class's name and its file inside nanoserve: "Llama (models/llama.py)"."""
    cls = obj if isinstance(obj, type) else type(obj)
    try:
        path = Path(inspect.getfile(cls)).resolve()
        package = Path(__file__).resolve().parent
        file = path.relative_to(package).as_posix() if path.is_relative_to(package) else path.name
    except (TypeError, OSError):
        file = cls.__module__
    return f"{cls.__name__} ({file})"


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)
