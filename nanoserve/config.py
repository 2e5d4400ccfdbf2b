"""EngineConfig: every setting of an engine, validated in one place.

The config only checks values that make sense on their own. Settings that
depend on the model (its maximum context, its KV head count) are resolved by
the engine after loading, in `resolve()`, which fills in `num_blocks` and
`max_model_len` and rejects combinations that could never run.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import FieldError


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny-llama"           # HF id, local directory, .gguf file, "smollm2", "tiny-gpt2" or "tiny-llama"
    dtype: str = "float32"              # weights and KV cache: "float32", "bfloat16" or "float16"
    device: str = "cpu"                 # "cpu" or "cuda"
    block_size: int = 16                # tokens per KV block
    num_blocks: int | None = None       # KV blocks in the pool; None: as many as kv_cache_memory_mb holds
    kv_cache_memory_mb: float = 256.0   # KV budget used when num_blocks is None
    max_num_seqs: int = 32              # at most this many requests run in one step
    max_num_batched_tokens: int = 512   # token budget of one step (decodes + prefill chunks)
    max_model_len: int | None = None    # prompt + output limit; None: the model's, capped by the pool and budget
    enable_chunked_prefill: bool = True  # let a long prompt spread over several steps
    enable_prefix_caching: bool = True  # radix prefix cache: reuse the KV of shared prefixes (radix_cache.py)
    preemption_mode: str = "recompute"  # a preempted request's KV: "recompute" it later or "swap" it to CPU
    preemption_policy: str = "newest"   # victim: "newest" admitted, lowest "priority", or "shortest_remaining" keeps
                                        # the ones closest to done (the most tokens left is preempted first)
    num_cpu_blocks: int | None = None   # swap space in blocks; None: as many as num_blocks when swapping
    attention_backend: str = "auto"     # "torch", "triton" (interpreted on CPU: slow) or "auto" (triton on CUDA)
    fast_paths: bool = True             # runner.py's speed paths; False: the plain reference path (same tokens)
    seed: int = 0                       # seeds random weights of tiny models and unseeded requests
    # Speculative decoding (spec_decode.py): off unless a method is named.
    speculative_method: str | None = None   # None, "ngram" (prompt lookup) or "draft" (a draft model)
    num_speculative_tokens: int = 4     # k: tokens proposed per step
    ngram_min: int = 1                  # shortest suffix the n-gram proposer looks up
    ngram_max: int = 4                  # longest suffix it tries first
    draft_model: str | None = None      # "draft": a model with the target's vocabulary; None: truncated target
    draft_num_layers: int = 2           # layers kept when the draft is the truncated target
    # Tensor parallelism (distributed/): the model split over this many processes, each with its own KV heads.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.kv_cache_memory_mb <= 0:
            raise ValueError(f"kv_cache_memory_mb must be positive, got {self.kv_cache_memory_mb}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_policy not in ("newest", "priority", "shortest_remaining"):
            raise ValueError("preemption_policy must be 'newest', 'priority' or 'shortest_remaining', "
                             f"got {self.preemption_policy!r}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if not isinstance(self.fast_paths, bool):
            raise ValueError(f"fast_paths must be True or False, got {self.fast_paths!r}")
        if self.attention_backend not in ("torch", "triton", "auto"):
            raise ValueError(f"attention_backend must be 'torch', 'triton' or 'auto', got {self.attention_backend!r}")

        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be None, 'ngram' or 'draft', got {self.speculative_method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens (k) must be at least 1, got {self.num_speculative_tokens}")
        if self.ngram_min < 1:
            raise ValueError(f"ngram_min must be at least 1, got {self.ngram_min}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"n-gram bounds need ngram_min <= ngram_max, got {self.ngram_min} > {self.ngram_max}")
        if self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be at least 1, got {self.draft_num_layers}")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise FieldError("tensor_parallel_size", f"must be a whole number of at least 1, "
                                                     f"got {self.tensor_parallel_size!r}")

    def resolved_backend(self) -> str:
        """The attention backend this config runs: "auto" is Triton on CUDA (when installed), else torch."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.device.startswith("cuda"):
            import importlib.util
            if importlib.util.find_spec("triton") is not None:
                return "triton"
        return "torch"

    def resolve(self, model_max_len: int, bytes_per_block: int) -> None:
        """Fill in num_blocks and max_model_len once the model is known."""
        if self.num_blocks is None:
            self.num_blocks = max(1, int(self.kv_cache_memory_mb * 2**20) // bytes_per_block)
        if self.num_cpu_blocks is None:
            self.num_cpu_blocks = self.num_blocks if self.preemption_mode == "swap" else 0
        pool_tokens = self.num_blocks * self.block_size
        if self.max_model_len is None:
            limit = min(model_max_len, pool_tokens)
            if not self.enable_chunked_prefill:
                # Without chunking a whole prompt must fit in one step's budget.
                limit = min(limit, self.max_num_batched_tokens)
            self.max_model_len = limit
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {model_max_len} positions")
        elif not self.enable_chunked_prefill and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) or a long prompt could never be scheduled"
            )
