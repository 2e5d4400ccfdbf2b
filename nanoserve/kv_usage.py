"""How full the KV pool is and how often the prefix cache hits: one definition for every screen.

The TUI (from a folded `ViewState`), the server's /metrics (from the live
engine) and the what-if comparisons (from a trace) all count the same three
kinds of block and the same hit rate, with the words below, so two screens
watching one engine show the same numbers:

    used     held by at least one request's block table (the prefix cache may hold it too)
    cached   held by the prefix cache alone: nobody runs on it, a hit can reuse it, eviction can free it
    free     in the free queue

    hit rate = prompt tokens whose KV came from the prefix cache / prompt tokens looked up,
               counted since the engine started (not since a viewer attached)

used + cached + free = the pool. This module owns the arithmetic and the
words; where the three counts come from is the caller's business
(`ViewState.kv_usage()` in view.py, the pool and the radix tree in
serve/metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The words each screen shows next to the numbers (the TUI's help and /metrics' HELP lines).
USED = "held by a request's block table (the prefix cache may hold it too)"
CACHED = "held by the prefix cache alone: evictable, reusable by a hit"
FREE = "in the free queue"
HIT_RATE = "prompt tokens whose KV came from the prefix cache / prompt tokens looked up, since the engine started"


@dataclass(frozen=True, slots=True)
class KVUsage:
    """The pool split three ways; the counts add up to the pool."""

    used: int      # see USED
    cached: int    # see CACHED
    free: int      # see FREE

    def __post_init__(self) -> None:
        if min(self.used, self.cached, self.free) < 0:
            raise ValueError(f"block counts cannot be negative: {self}")

    @property
    def total(self) -> int:
        return self.used + self.cached + self.free


def kv_usage(num_blocks: int, num_free: int, num_cached_only: int) -> KVUsage:
    """The pool of `num_blocks` with `num_free` in the free queue and `num_cached_only` held by the
    prefix cache alone (0 without a prefix cache); the rest is used."""
    return KVUsage(num_blocks - num_free - num_cached_only, num_cached_only, num_free)


def hit_rate(hit_tokens: int, lookup_tokens: int) -> float | None:
    """See HIT_RATE; None before any prompt was looked up (no rate yet, not 0 %)."""
    return hit_tokens / lookup_tokens if lookup_tokens else None
