"""`nanoserve bench roofline`: how close a decode step comes to the memory's speed, measured on this machine.

A decode step computes one new token per sequence. For that it reads every
weight of the model once (each matmul streams its whole weight matrix past
the step's few rows), plus each sequence's K/V, and does about two
floating-point operations per weight per sequence. At batch 1 that is
~1 FLOP per byte of bf16 weight: the CPU could do twenty to a hundred times
more arithmetic in the time the memory takes to deliver the bytes. So the
step's time cannot be shorter than

    floor = bytes the step must read / memory bandwidth

and a batch of B sequences reads the weights once for all of them: the floor
grows only by their K/V, and tokens per second grow almost B-fold until the
arithmetic, not the memory, sets the pace. This module measures the three
numbers that say so:

    bandwidth   torch reads (a sum) and copies ~0.5 GB, more than any cache holds; the best of a few runs
    bytes       per step: every weight once (a tied embedding once, as the LM head), plus each
                sequence's K/V read at its context length and its new K/V written
    steps       the median time of a decode step at batch 1, 8 and 32 (prompts of `context` tokens,
                the engine as configured: the fast path unless told otherwise)

and reports, per batch, the floor, the measured step, the fraction of the
floor achieved (floor / step) and tokens per second, and can draw them
(`plot`). The lesson docs/concepts/roofline.md reads these figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

# torch is imported where it is used: `nanoserve --help` imports this module (the `bench` parser)


@dataclass(slots=True)
class Bandwidth:
    """This machine's memory speed, as torch sees it with the threads it has."""

    read_gbs: float        # a sum over a buffer far larger than the caches: bytes read per second / 1e9
    copy_gbs: float        # a copy: bytes read + bytes written per second / 1e9
    threads: int

    @property
    def best_gbs(self) -> float:
        """What the roofline divides by: the faster of the two (both are lower bounds of what memory can do)."""
        return max(self.read_gbs, self.copy_gbs)


@dataclass(slots=True)
class BatchPoint:
    """One batch size: what a decode step must read, how long it took, and what that means."""

    batch: int
    context: int            # tokens of K/V each sequence attends (its prompt plus the tokens decoded so far)
    bytes: int              # read and written by one step: weights + K/V
    step_s: float           # median measured step time (s)
    floor_s: float          # bytes / bandwidth

    @property
    def fraction(self) -> float:
        """The share of the memory's speed the step reached (1.0: at the roofline)."""
        return self.floor_s / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


@dataclass(slots=True)
class Roofline:
    model: str
    dtype: str
    implementation: str      # what ran (LLMEngine.implementation.summary())
    cpu: str
    bandwidth: Bandwidth
    weight_bytes: int
    points: list[BatchPoint] = field(default_factory=list)

    def table(self) -> str:
        """The figures as text, one line per batch."""
        bw = self.bandwidth
        lines = [f"{self.model} {self.dtype} on {self.cpu}, {bw.threads} threads",
                 f"memory: read {bw.read_gbs:.1f} GB/s, copy {bw.copy_gbs:.1f} GB/s; the roofline uses "
                 f"{bw.best_gbs:.1f}",
                 f"weights read once per step: {self.weight_bytes / 1e6:.0f} MB",
                 f"ran: {self.implementation}",
                 f"{'batch':>5} {'context':>7} {'MB/step':>8} {'floor ms':>9} {'step ms':>8} {'of roofline':>11} "
                 f"{'tokens/s':>9}"]
        for p in self.points:
            lines.append(f"{p.batch:5d} {p.context:7d} {p.bytes / 1e6:8.1f} {1e3 * p.floor_s:9.2f} "
                         f"{1e3 * p.step_s:8.2f} {100 * p.fraction:10.0f}% {p.tokens_per_s:9.1f}")
        return "\n".join(lines)


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> Bandwidth:
    """Read and copy a float32 buffer of `megabytes` (far past the caches) `repeats` times each; the best of each."""
    import torch

    n = megabytes * 2**20 // 4
    a, b = torch.ones(n), torch.empty(n)
    b.copy_(a)                                  # touch every page before timing
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        t1 = time.perf_counter()
        b.copy_(a)
        t2 = time.perf_counter()
        best_read, best_copy = min(best_read, t1 - t0), min(best_copy, t2 - t1)
    return Bandwidth(4 * n / best_read / 1e9, 8 * n / best_copy / 1e9, torch.get_num_threads())


def weight_bytes(model) -> int:
    """Bytes of the weights a step reads once: every floating-point parameter and buffer, each storage once (a
    tied embedding is the LM head's weight), less an untied embedding table (a step reads only its rows)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    skip = set()
    if embed is not None and (head is None or head.weight.data_ptr() != embed.weight.data_ptr()):
        skip.add(embed.weight.data_ptr())
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.data_ptr()
        if t.is_floating_point() and ptr not in seen and ptr not in skip:
            seen.add(ptr)
            total += t.numel() * t.element_size()
    return total


def kv_bytes(model, dtype, batch: int, context: int) -> int:
    """K/V a decode step reads (every sequence's `context` tokens, every layer) and writes (its new token)."""
    import torch

    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * torch.empty((), dtype=dtype).element_size()
    return batch * (context + 1) * per_token


def decode_steps(engine, batch: int, prompt_len: int, steps: int, seed: int = 0) -> tuple[float, int]:
    """Start `batch` requests of `prompt_len` random tokens, decode `steps` steps with all of them running;
    (median step time, mean context length of those steps)."""
    import torch

    from nanoserve import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"roofline-{seed}-{i}", prompt,
                           SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    while engine.step().stats.num_prefill_tokens:       # the prefills (not timed): until a step has none
        pass
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), prompt_len + 1 + steps // 2


def measure(model: str = "smollm2", batches: tuple[int, ...] = (1, 8, 32), prompt_len: int = 256,
            steps: int = 16, bandwidth_mb: int = 512, **config) -> Roofline:
    """The roofline of this machine for `model`: bandwidth, bytes per step, and a measured step per batch size.
    `config`: more EngineConfig fields (dtype="bfloat16"; path="reading" measures the reading path)."""
    from nanoserve import EngineConfig, LLMEngine

    bandwidth = measure_bandwidth(bandwidth_mb)
    config = {"max_num_seqs": max(batches), "max_num_batched_tokens": max(512, prompt_len),
              "kv_cache_memory_mb": 1024, **config}     # room for every sequence: no preemption in the timing
    engine = LLMEngine(EngineConfig(model=model, **config))
    loaded = engine.loaded.model
    kv_dtype = engine.runner.kv_caches[0][0].dtype
    weights = weight_bytes(loaded)
    result = Roofline(model, str(kv_dtype).removeprefix("torch."), engine.implementation.summary(), cpu_name(),
                      bandwidth, weights)
    decode_steps(engine, 1, 8, 2, seed=99)                     # warm up: kernels built, memory touched
    for b in batches:
        step_s, context = decode_steps(engine, b, prompt_len, steps, seed=b)
        nbytes = weights + kv_bytes(loaded, kv_dtype, b, context)
        result.points.append(BatchPoint(b, context, nbytes, step_s, nbytes / (bandwidth.best_gbs * 1e9)))
    engine.shutdown()
    return result


def cpu_name() -> str:
    """The CPU's model name and its widest vector units (from /proc/cpuinfo where there is one)."""
    import platform
    from pathlib import Path

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.processor() or platform.machine()):
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    units = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(units)})" if units else name


def plot(result: Roofline, path: str) -> None:
    """Two panels: each batch's step time against its floor; tokens per second against the roofline's ceiling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.points
    labels = [str(p.batch) for p in pts]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(pts))
    ax.bar([i - 0.2 for i in x], [1e3 * p.floor_s for p in pts], 0.4, label="floor: bytes / bandwidth",
           color="tab:gray")
    ax.bar([i + 0.2 for i in x], [1e3 * p.step_s for p in pts], 0.4, label="measured step", color="tab:blue")
    for i, p in zip(x, pts):
        ax.text(i + 0.2, 1e3 * p.step_s, f"{100 * p.fraction:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("sequences decoded together (batch)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("a step's time: the memory floor and the measurement", fontsize=9)
    ax.legend(fontsize=8)
    ceiling = [p.batch / p.floor_s for p in pts]
    ax2.plot([p.batch for p in pts], ceiling, "o--", color="tab:gray", label="if every step ran at the floor")
    ax2.plot([p.batch for p in pts], [p.tokens_per_s for p in pts], "o-", color="tab:blue", label="measured")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xticks([p.batch for p in pts], labels)
    ax2.set_xlabel("batch")
    ax2.set_ylabel("tokens per second")
    ax2.set_title("the weights are read once per step, whatever the batch", fontsize=9)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result.model} {result.dtype}, {result.bandwidth.threads} threads, {result.cpu}: "
                 f"memory {result.bandwidth.best_gbs:.1f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- `nanoserve bench roofline` ---------------------------------------------------------------------------


def add_bench_parser(sub) -> None:
    """`nanoserve bench roofline [flags]` (the engine's flags too: --dtype, --path ...)."""
    from nanoserve.engine_flags import add_engine_flags

    bench = sub.add_parser("bench", help="measure this machine: `nanoserve bench roofline`",
                           description="Measurements a learner can run on their own machine.")
    what = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    p = what.add_parser("roofline", help="memory bandwidth, the bytes a decode step reads, and how close the "
                                         "engine comes at batch 1, 8 and 32",
                        description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default="smollm2", help="(default: %(default)s)")
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of each prompt (default: %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch (default: %(default)s)")
    p.add_argument("--output", "-o", default=None, help="also draw the figures: a .png or .svg file")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads (default: $NANOSERVE_THREADS, else the CPU cores free right now)")
    add_engine_flags(p.add_argument_group("engine", "settings of the engine (EngineConfig fields)"), own=("model",))


def cmd_bench(args) -> int:
    from nanoserve.engine_flags import engine_settings
    from nanoserve.errors import FieldError
    from nanoserve.threads import apply_thread_policy

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise FieldError("batches", f"must be positive whole numbers separated by commas, got {args.batches!r}")
    if args.output is not None and not args.output.endswith((".png", ".svg")):
        raise FieldError("output", f"must name a .png or .svg file, got {args.output!r}")
    note = apply_thread_policy(args.threads).note()
    if note:
        print(note)
    result = measure(args.model, batches, args.prompt_len, args.steps, **engine_settings(args))
    print(result.table())
    if args.output is not None:
        plot(result, args.output)
        print(f"wrote {args.output}")
    return 0
