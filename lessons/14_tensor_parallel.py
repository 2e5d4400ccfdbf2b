"""Lesson 14: tensor parallelism, one model in two processes.

Run it:  python lessons/14_tensor_parallel.py

When a model does not fit one device, serving engines split every layer
across devices: each rank holds a slice of every weight, computes its part,
and the ranks add their parts up with an all-reduce. nanoserve does this
with torch.distributed (gloo on a CPU): `EngineConfig(tensor_parallel_size=2)`
starts one worker process, the scheduler stays in the driver, and every step
the driver broadcasts the batch and its block moves.

1. one layer split by hand: column-parallel then row-parallel = one sum;
2. a real TP=2 engine gives TP=1's tokens;
3. where the all-reduces go, counted from the engine's `CollectiveOps` events;
4. the per-rank pool: same block tables, each rank only its own KV heads;
5. what it costs on this CPU (measured, not asserted: here it is a lesson,
   not a speed-up).

Every claim is checked with an `assert` on `tiny-llama` (random weights,
4 query heads, 2 KV heads, hidden 64, 2 layers, one token per byte).
Everything runs inside `main()`: the worker process is started with
`spawn`, which imports this file again, and nothing may run then.
"""

from nanoserve.lesson import breaks, console, section  # prose that fits your terminal; --break NAME

# isort: split
# (lesson.py sets OMP_NUM_THREADS, which only counts before torch is imported)
import time  # noqa: E402

import torch  # noqa: E402
from rich.table import Table  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.distributed.layers import attach  # noqa: E402
from nanoserve.distributed.sharding import describe_shard, shard_model  # noqa: E402
from nanoserve.distributed.tensor_parallel import start_workers, stop_workers  # noqa: E402
from nanoserve.events import CollectiveOps, RankPoolState  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402

PROMPTS = ["Tensor parallelism splits", "every layer by heads", "and sums the parts."]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CONFIG = dict(model="tiny-llama", block_size=4, num_blocks=64, max_num_batched_tokens=64)


def generate(engine: LLMEngine, check: bool = True) -> tuple[dict, list]:
    """All prompts at once, to the end (invariants checked on every rank after every step)."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens, events = {}, []
    while engine.has_unfinished_requests():
        result = engine.step()
        if check:
            engine.check_invariants()
        events += result.events
        tokens.update({o.request_id: o.outputs[0].token_ids for o in result.outputs if o.finished})
    return tokens, events


class KeepParts:
    """Stands in for the all-reduce in section 1: keeps each rank's partial output instead of summing."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.parts.append(t.clone())
        return t


def main() -> None:
    broken = breaks({
        "no-all-reduce": "leave out the all-reduce after a row-parallel layer: rank 0's partial sum is the output",
        "all-kv-heads": "expect every rank's pool to hold all the KV heads, like TP=1's",
        "budget-per-engine": "expect kv_cache_memory_mb to buy as many blocks at TP=2 as at TP=1",
    })
    loaded = load_model("tiny-llama")
    model = loaded.model

    section("1. One layer, split by hand", """
Column-parallel layers keep some output rows of a weight (q, k, v: the rows of
their heads; gate and up: a slice of the MLP width), so each rank computes its
own slice of the output and nothing is sent. Row-parallel layers (the attention
output and the MLP's down projection) keep the matching input columns: each rank
gets a partial sum of the full output, and an all-reduce adds them. Layer 0's
weights on each rank, read from the real shards:""")
    table = Table("weight", "split", "rank 0 holds", "rank 1 holds", "then")
    shards = [describe_shard(shard_model(model, r, 2)) for r in range(2)]
    for w0, w1 in zip(*shards):
        runs = lambda w: ", ".join(f"{a}-{b - 1}" for a, b in w["owned"])   # noqa: E731
        table.add_row(w0["name"], w0["kind"], f"{w0['axis']} {runs(w0)}", f"{w1['axis']} {runs(w1)}",
                      w0["collective"] or "-")
    console.print(table)
    q0 = next(w for w in shards[0] if w["name"] == "q_proj")
    k1 = next(w for w in shards[1] if w["name"] == "k_proj")
    assert q0["owned"] == ((0, 32),) and k1["owned"] == ((16, 32),)   # query heads 0-1; KV head 1 (head_dim 16)
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    keep = KeepParts()
    with torch.inference_mode():
        for r in range(2):
            attach(shard_model(model, r, 2), keep).model.layers[0].mlp(x)   # gate/up slice, then down: a partial sum
        full = model.model.layers[0].mlp(x)
    summed = keep.parts[0] if broken == "no-all-reduce" else keep.parts[0] + keep.parts[1]
    error = float((summed - full).abs().max())
    assert error < 1e-5, (
        f"the MLP's output on rank 0 is {error:.1e} away from the unsplit MLP's: after a row-parallel layer "
        "(down_proj) each rank holds only a partial sum over its slice of the MLP width, and the all-reduce "
        "adds the ranks' parts into the full output")
    console.print("The MLP on 3 tokens: rank 0's partial output + rank 1's = the unsplit MLP's "
                  "(equal to 1e-5; each alone is not).")

    workers = start_workers(2)          # rank 1: one worker process, reused by the engines below
    try:
        section("2. A real engine with tensor_parallel_size=2", """
The driver keeps the scheduler, block pool and prefix cache; rank 1 is a
separate process (torch.multiprocessing, spawn). Each step the driver
broadcasts the inputs (tokens, positions, block tables) and the block moves,
every rank runs the forward on its shard, and the logits are gathered on rank
0, which samples.""")
        assert workers.alive and len(workers.pids) == 1
        single, _ = generate(LLMEngine(EngineConfig(**CONFIG), loaded=loaded))
        with LLMEngine(EngineConfig(**CONFIG, tensor_parallel_size=2), loaded=loaded, workers=workers) as engine:
            parallel, events = generate(engine)
            kv_shape = tuple(engine.runner.kv_caches[0][0].shape)
            block_bytes = engine.runner.local.bytes_per_block
        assert parallel == single
        console.print(f"Greedy tokens of {len(PROMPTS)} requests: TP=2 == TP=1 for all of them.")

        section("3. Where the all-reduces go", """
Per step: one broadcast of the batch, one all-reduce for the vocab-parallel
embedding (each rank looks up only its token ids, zeros elsewhere), one after
each layer's attention output and one after its MLP, one gather of the logits
(each rank computes the logits of its half of the vocabulary). Step 1 (three
prompts, T tokens), from the engine's CollectiveOps events:""")
        first = [e for e in events if isinstance(e, CollectiveOps) and e.step == 1]
        table = Table("kind", "calls", "bytes from rank 0")
        for e in first:
            table.add_row(e.kind, str(e.count), str(e.num_bytes))
        console.print(table)
        ops = {e.kind: e for e in first}
        tokens = sum(len(p.encode()) for p in PROMPTS)
        layers, hidden = model.num_layers, 64
        assert ops["all_reduce"].count == 2 * layers + 1
        assert ops["all_reduce"].num_bytes == (2 * layers + 1) * tokens * hidden * 4   # [T, hidden] float32 each
        assert ops["gather"].num_bytes == len(PROMPTS) * 129 * 4   # a logits row of 129 of the 257 ids per request
        console.print(f"T = {tokens}: {2 * layers + 1} all-reduces of [T, {hidden}] float32 = "
                      f"{ops['all_reduce'].num_bytes} bytes, as counted.")

        section("4. The per-rank pool", f"""
Every rank has its own KV pool with the same block ids, and the same block
tables reach every rank in the broadcast, so copy-on-write copies, swaps and
prefix-cache hits happen on every rank alike. What differs is what a block
holds: rank r keeps only its own KV heads. Rank 0's cache per layer is
{kv_shape} (blocks, slots, KV heads, head_dim).""")
        want_heads = model.num_kv_heads if broken == "all-kv-heads" else model.num_kv_heads // 2
        assert kv_shape[2] == want_heads, (
            f"rank 0's pool holds {kv_shape[2]} KV head(s) per slot, not {want_heads}: attention works head by "
            "head, so each rank keeps only the KV of the heads it computes (its q/k/v rows), and a block on "
            "each rank is 1/N of TP=1's")
        reports = [e for e in events if isinstance(e, RankPoolState)]
        assert all(e.kv_heads == (e.rank,) for e in reports)
        by_step: dict[int, list] = {}
        for e in reports:
            by_step.setdefault(e.step, []).append(e)
        # Each rank reports its own work; the slot ledgers (which token each slot holds) agree.
        assert all(len({(e.num_blocks_written, e.digest) for e in pair}) == 1 for pair in by_step.values())
        console.print(f"After every step both ranks reported the same blocks written and the same slot "
                      f"ledger digest ({len(by_step)} steps); check_invariants() compared each rank's "
                      f"ledger with the driver's block tables after every step.")
        budget = dict(model="tiny-llama", block_size=4, kv_cache_memory_mb=1.0)
        one = LLMEngine(EngineConfig(**budget), loaded=loaded).config.num_blocks
        with LLMEngine(EngineConfig(**budget, tensor_parallel_size=2), loaded=loaded, workers=workers) as engine:
            two = engine.config.num_blocks
        want = one if broken == "budget-per-engine" else 2 * one
        assert two == want, (
            f"kv_cache_memory_mb=1 bought {two} blocks at TP=2, not {want}: the budget is per rank, and a "
            f"block on each rank holds half the KV heads ({block_bytes} bytes instead of {2 * block_bytes}), "
            "so the same memory on every rank holds twice the blocks")
        console.print(f"A block is {block_bytes} bytes on each rank, half of TP=1's. The KV budget is per "
                      f"rank, so kv_cache_memory_mb=1 holds {one} blocks at TP=1 and {two} at TP=2.")

        section("5. What it costs here", """
Measured on this machine (nothing asserted, and different on every run): the
same greedy batch, TP=1 and TP=2. On a 2-core CPU two processes compete for
the same cores and memory, and each all-reduce is a round trip through the
kernel's loopback: tensor parallelism is a lesson here, not a speed-up. On
GPUs with NVLink an all-reduce takes microseconds and each GPU reads only its
share of the weights.""")
        for size in (1, 2):
            extra = {"workers": workers} if size == 2 else {}
            with LLMEngine(EngineConfig(**CONFIG, tensor_parallel_size=size), loaded=loaded, **extra) as engine:
                t0 = time.perf_counter()
                _, events = generate(engine, check=False)
                elapsed = time.perf_counter() - t0
            steps = sum(1 for e in events if type(e).__name__ == "StepFinished")
            comm = sum(e.duration_s for e in events if isinstance(e, CollectiveOps))
            console.print(f"TP={size}: {steps} steps in {elapsed:.2f} s ({1000 * elapsed / steps:.1f} ms a step), "
                          f"of which collectives {1000 * comm / steps:.1f} ms")
    finally:
        stop_workers(workers)
    console.print("All checks passed.", style="bold green")


if __name__ == "__main__":   # (the spawned worker imports this file as a module: nothing may run then)
    main()
