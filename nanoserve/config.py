"""EngineConfig: every setting of an engine, validated in one place.

The config checks each value's type and range on its own (`__post_init__`; a
bad one raises `FieldError` naming the field, which the CLI turns into its
flag). Settings that depend on the model (its maximum context, its KV head
count) are resolved by the engine after loading, in `resolve()`, which fills
in `num_blocks` and `max_model_len`, rejects combinations that could never
run, and refuses pools larger than the KV budget or the machine's free
memory before a single block is allocated.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from nanoserve import validation as v
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
    kv_window_freeing: bool = True      # a model mixing sliding-window and full layers keeps one block table per
                                        # KV cache group and frees the blocks its windows passed (kv_groups.py);
                                        # False: one table for every layer, every token's KV kept
    preemption_mode: str = "recompute"  # a preempted request's KV: "recompute" it later or "swap" it to CPU
    preemption_policy: str = "newest"   # victim: "newest" admitted, lowest "priority", or "shortest_remaining" keeps
                                        # the ones closest to done (the most tokens left is preempted first)
    num_cpu_blocks: int | None = None   # swap space in blocks; None: as many as num_blocks when swapping
    path: str = "fast"                  # which code computes a step (implementation.py decides): "fast", on a
                                        # CPU nanoserve/cpu/ with its C files where they build; "torch", the
                                        # same without the C files; "reading", models/ and kernels/reference.py
                                        # only. The same tokens on every path. (Older names: fast_paths=False
                                        # is "reading", c_kernels=False is "torch".)
    attention_backend: str = "auto"     # "torch", "triton" (interpreted on CPU: slow), "cpu" (the C kernel of
                                        # cpu/attention.c, on the "fast" path) or "auto": implementation.choose
    enforce_eager: bool | None = None   # CUDA graphs for pure-decode steps (cuda_graphs.py): None = on for CUDA,
                                        # True = off; False = on, and on a CPU the same padded path runs uncaptured
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
    # The older names of `path`, still accepted (traces, scripts): not fields, so no flag or trace carries them.
    fast_paths: InitVar[bool | None] = None   # False: path="reading"
    c_kernels: InitVar[bool | None] = None    # False: path="torch"

    def __post_init__(self, fast_paths: bool | None = None, c_kernels: bool | None = None) -> None:
        """Check every field's type and range; a bad one raises FieldError naming it."""
        self.path = _path(self.path, fast_paths, c_kernels)
        self.model = v.text("model", self.model)
        v.choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        self.device = _check_device(self.device)
        self.block_size = v.integer("block_size", self.block_size, minimum=1)
        self.num_blocks = v.optional_integer("num_blocks", self.num_blocks, minimum=1)
        self.kv_cache_memory_mb = v.number("kv_cache_memory_mb", self.kv_cache_memory_mb)
        if self.kv_cache_memory_mb <= 0:
            raise FieldError("kv_cache_memory_mb", f"must be positive, got {self.kv_cache_memory_mb}")
        self.max_num_seqs = v.integer("max_num_seqs", self.max_num_seqs, minimum=1)
        self.max_num_batched_tokens = v.integer("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        self.max_model_len = v.optional_integer("max_model_len", self.max_model_len, minimum=2)
        v.boolean("enable_chunked_prefill", self.enable_chunked_prefill)
        v.boolean("enable_prefix_caching", self.enable_prefix_caching)
        v.boolean("kv_window_freeing", self.kv_window_freeing)
        v.choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        v.choice("preemption_policy", self.preemption_policy, ("newest", "priority", "shortest_remaining"))
        self.num_cpu_blocks = v.optional_integer("num_cpu_blocks", self.num_cpu_blocks, minimum=0)
        v.choice("attention_backend", self.attention_backend, ("torch", "triton", "cpu", "auto"))
        if self.attention_backend == "cpu" and not (self.device == "cpu" and self.path == "fast"):
            raise FieldError("attention_backend", "'cpu' is the CPU fast path's C kernel: it needs device='cpu' "
                                                  "and path='fast'")
        if self.enforce_eager is not None:
            v.boolean("enforce_eager", self.enforce_eager)
        self.seed = v.integer("seed", self.seed, minimum=0, maximum=2**64 - 1)

        v.choice("speculative_method", self.speculative_method, (None, "ngram", "draft"))
        self.num_speculative_tokens = v.integer("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        self.ngram_min = v.integer("ngram_min", self.ngram_min, minimum=1)
        self.ngram_max = v.integer("ngram_max", self.ngram_max, minimum=1)
        if self.ngram_min > self.ngram_max:
            raise FieldError("ngram_min", f"must be <= ngram_max (n-gram bounds need ngram_min <= ngram_max), "
                                          f"got {self.ngram_min} > {self.ngram_max}")
        if self.draft_model is not None:
            v.text("draft_model", self.draft_model)
        self.draft_num_layers = v.integer("draft_num_layers", self.draft_num_layers, minimum=1)
        self.tensor_parallel_size = v.integer("tensor_parallel_size", self.tensor_parallel_size, minimum=1)

    def resolve(self, model_max_len: int, bytes_per_block: int, draft_bytes_per_block: int = 0) -> None:
        """Fill in num_blocks and max_model_len once the model is known.

        `bytes_per_block` is the KV of one block in every layer; `draft_bytes_per_block` the
        draft model's (speculative decoding keeps a second pool as large). The pools are
        checked against the KV budget and the machine's free memory here, before anything
        is allocated; on a FieldError the config is left as it was.
        """
        num_blocks = self.num_blocks
        if num_blocks is None:
            budget = int(self.kv_cache_memory_mb * 2**20)
            if bytes_per_block > budget:
                raise FieldError("block_size", f"of {self.block_size} tokens makes one KV block "
                                               f"{_size(bytes_per_block)}, more than kv_cache_memory_mb="
                                               f"{self.kv_cache_memory_mb:g}: lower it or raise the budget")
            num_blocks = budget // bytes_per_block
        num_cpu_blocks = self.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks if self.preemption_mode == "swap" else 0
        self._check_memory(num_blocks, num_cpu_blocks, bytes_per_block, draft_bytes_per_block)
        pool_tokens = num_blocks * self.block_size
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(model_max_len, pool_tokens)
            if not self.enable_chunked_prefill:
                # Without chunking a whole prompt must fit in one step's budget.
                max_model_len = min(max_model_len, self.max_num_batched_tokens)
        elif max_model_len > model_max_len:
            raise FieldError("max_model_len", f"of {max_model_len} exceeds the model's {model_max_len} positions")
        elif not self.enable_chunked_prefill and max_model_len > self.max_num_batched_tokens:
            raise FieldError("max_num_batched_tokens",
                             f"({self.max_num_batched_tokens}) must be >= max_model_len ({max_model_len}) "
                             "with chunked prefill off, or a long prompt could never be scheduled")
        self.num_blocks, self.num_cpu_blocks, self.max_model_len = num_blocks, num_cpu_blocks, max_model_len

    def _check_memory(self, num_blocks: int, num_cpu_blocks: int, bytes_per_block: int, draft_bytes: int) -> None:
        """Refuse pools the machine cannot hold (KV tensors plus about 100 bytes of bookkeeping per block)."""
        device_kv = num_blocks * (bytes_per_block + draft_bytes)              # on `device`
        host = num_cpu_blocks * bytes_per_block + (2 * num_blocks + num_cpu_blocks) * _BOOKKEEPING_BYTES
        pools = f"{num_blocks} blocks of {self.block_size} tokens, {_size(bytes_per_block)} each"
        if num_cpu_blocks:
            pools += f" and {num_cpu_blocks} CPU blocks for swapping"
        field = "num_blocks" if self.num_blocks is not None else "kv_cache_memory_mb"
        cpu_field = "num_cpu_blocks" if self.num_cpu_blocks is not None else field
        if self.device.startswith("cuda"):
            checks = [(field, device_kv, self.device), (cpu_field, host, "cpu")]
        else:   # one memory for both: blame the larger part
            checks = [(cpu_field if host > device_kv else field, device_kv + host, "cpu")]
        for name, need, device in checks:
            have = v.available_memory(device)
            if have is not None and need > have:
                raise FieldError(name, f"asks for {_size(need)} on {device} for the KV cache and its bookkeeping "
                                       f"({pools}); only {_size(have)} is free")


PATHS = ("fast", "torch", "reading")   # EngineConfig.path, fastest first
OLD_NAMES = {"fast_paths": (False, "reading"), "c_kernels": (False, "torch")}   # older setting: (value, path)


def _path(path: str, fast_paths: bool | None, c_kernels: bool | None) -> str:
    """`path`, or what the older names ask for: fast_paths=False is "reading", c_kernels=False is "torch"."""
    v.choice("path", path, PATHS)
    for name, value in (("fast_paths", fast_paths), ("c_kernels", c_kernels)):
        if value is not None:
            v.boolean(name, value)
    if fast_paths is False:
        return "reading"
    if c_kernels is False and path == "fast":
        return "torch"
    return path


def current_names(settings: dict) -> dict:
    """Engine settings by name (a trace's, a --set's) with the older names of `path` turned into it."""
    old = {name: settings[name] for name in OLD_NAMES if name in settings}
    if not old:
        return dict(settings)
    rest = {k: value for k, value in settings.items() if k not in OLD_NAMES}
    return rest | {"path": _path(rest.get("path", "fast"), old.get("fast_paths"), old.get("c_kernels"))}


_BOOKKEEPING_BYTES = 100   # a Block object and its place in the pool's lists


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"


def _check_device(device) -> str:
    """"cpu", "cuda" or "cuda:N", and a CUDA device only where torch sees one (`loader.check_device`)."""
    from nanoserve.models.loader import check_device  # (here, not at the top: the loader imports a lot)

    check_device(v.text("device", device))
    return device
