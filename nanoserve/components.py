"""The engine's replaceable parts: which class or function builds each component.

`LLMEngine` does not name `BlockPool` or `RadixCache` directly: it builds every
component from a `Components` record, and the default record holds the
engine's own classes. Handing it another record is the one way to run the
real engine with a part you wrote (that is what `nanoserve lab` does):

    from nanoserve import LLMEngine, EngineConfig
    from nanoserve.components import Components
    import my_block_pool

    engine = LLMEngine(EngineConfig(model="tiny-llama"),
                       components=Components(block_pool=my_block_pool.BlockPool))

Each field is called exactly as the engine calls its own default, so a
replacement keeps the default's constructor (or function) signature:

    block_pool(num_blocks, block_size)                 -> a BlockPool-like object
    radix_cache(pool, emit, span_text, clock=clock)    -> a RadixCache-like object
    kv_manager(pool, radix, cpu_pool, emit, clock=clock) -> a KVManager-like object
    scheduler(config, kv, emit, clock=clock)           -> a Scheduler-like object
    request_table(config, scheduler, kv, proposer, tokenizer, eos_token_id, emit, clock=clock)
                                                       -> a RequestTable-like object
    verify(p, draft, q, greedy, generator)             -> (tokens, num_accepted)
    attention_backend(name, grouped)                   -> an AttentionBackend ("torch" or "triton")

(`clock` is the engine's `events.StepClock`: the one step number every part stamps
its events with.) Nothing here is global: two engines in one process can run different parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoserve import spec_decode
from nanoserve.block_pool import BlockPool
from nanoserve.kernels.backends import make_backend
from nanoserve.kv_manager import KVManager
from nanoserve.radix_cache import RadixCache
from nanoserve.request_table import RequestTable
from nanoserve.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Components:
    """Which class (or function) the engine builds each part from; defaults are the engine's own."""

    block_pool: Callable[..., Any] = BlockPool      # the device pool (and the CPU pool for swap)
    radix_cache: Callable[..., Any] = RadixCache    # the prefix cache (built only with prefix caching on)
    kv_manager: Callable[..., Any] = KVManager      # block work per scheduler decision (fork, CoW, swap)
    scheduler: Callable[..., Any] = Scheduler       # who runs each step, within the token budget
    request_table: Callable[..., Any] = RequestTable   # the live requests; applies each step's tokens
    verify: Callable[..., Any] = spec_decode.verify  # speculative decoding's acceptance rule
    attention_backend: Callable[..., Any] = make_backend   # the target model's attention kernels

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not callable(getattr(self, f.name)):
                raise TypeError(f"Components.{f.name} must be a class or function, "
                                f"got {type(getattr(self, f.name)).__name__}")

    def replaced(self) -> dict[str, Any]:
        """The fields that differ from the engine's defaults, by name (for a title or a log line)."""
        default = Components()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not getattr(default, f.name)}
