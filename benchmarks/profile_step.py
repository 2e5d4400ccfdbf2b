"""Where a step's time goes: schedule, prepare, forward (by layer, attention apart), sample, postprocess, events.

    python benchmarks/profile_step.py                       # SmolLM2-135M, bench_throughput's workload
    python benchmarks/profile_step.py --dtype bfloat16 --set path=reading
    python benchmarks/profile_step.py --model tiny-llama --steps 30 --no-plot

It runs bench_throughput.py's workload (32 requests, all at once) for `--steps`
steps, twice in one process: once with nobody subscribed to the events
("events off": the engine still builds them, nothing consumes them) and once
with a subscriber that folds every event into the view state the TUI draws
("events on"). Phases are timed by wrapping the engine's parts from outside
(nothing in the engine changes):

    schedule     scheduler.schedule()
    prepare      runner.prepare(): the token row and the backend's metadata
    forward      runner.run(): per layer (forward hooks), attention apart
                 (the backend's forward), the rest = embedding, final norm, LM head; with the CPU
                 Llama's layers in one C call (cpu/forward.c), that call is "layers" (attention
                 inside it; --loop calls them from Python, attention apart)
    sample       the sampler
    events       delivering events to subscribers (events on: folding each one);
                 building and recording them happens inside schedule and postprocess
    postprocess  the rest of step(): appending tokens, detokenizing, stop checks,
                 freeing, caching full blocks, building the step's result

It prints the mean of each phase per kind of step (prefill-heavy, decode at
the largest batch, small decode batches), the bookkeeping share (schedule +
postprocess + events) with events off and on, and draws docs/img/step_profile.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import DTYPES, workload  # noqa: E402

from nanoserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from nanoserve.config import current_names  # noqa: E402
from nanoserve.fold import fold  # noqa: E402
from nanoserve.models.loader import load_model  # noqa: E402

PHASES = ["schedule", "prepare", "attention", "layers (no attention)", "embed + norm + LM head", "sample",
          "postprocess", "events"]


class Timer:
    """Adds the wall time of wrapped calls into the current step's record."""

    def __init__(self) -> None:
        self.rec: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.rec[name] += time.perf_counter() - t0
        return timed


def instrument(engine: LLMEngine, timer: Timer):
    """Wrap the engine's parts; returns the list that collects (layer, attention) times of each step,
    and the layer hooks' handles (the model may be shared: remove them after the run)."""
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    runner = engine.runner
    runner.prepare = timer.wrap("prepare", runner.prepare)
    runner.run = timer.wrap("forward", runner.run)
    attn_calls: list[float] = []          # this step's attention time, layer by layer

    def timed_attention(*args, fn=runner.attn.forward):
        t0 = time.perf_counter()
        out = fn(*args)
        attn_calls.append(time.perf_counter() - t0)
        return out

    runner.attn.forward = timed_attention
    one_call = getattr(runner.model, "one_call", None)      # cpu/forward.c: every layer in one C call
    if one_call is not None:
        one_call.run = timer.wrap("one call", one_call.run)
    engine.sampler = timer.wrap("sample", engine.sampler)
    engine.bus.publish = timer.wrap("events", engine.bus.publish)   # the subscribers (fold, when on)
    # GPT-2's blocks, cpu/llama.py's layers (a float32 Llama on a CPU), or llama.py's model.layers
    layers = getattr(runner.model, "blocks", None) or getattr(runner.model, "layers", None) \
        or runner.model.model.layers
    per_layer: list[list[float]] = []
    starts: dict[int, float] = {}

    def pre(module, args, idx):
        starts[idx] = time.perf_counter()

    def post(module, args, out, idx):
        if idx == 0:
            per_layer.append([])
        # (layer total, its attention): the attention call this layer just made is the last one
        per_layer[-1].append((time.perf_counter() - starts[idx], attn_calls[-1] if attn_calls else 0.0))

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: pre(m, a, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: post(m, a, o, i)))
    return per_layer, handles


def run(loaded, reqs, config: dict, steps: int, events_on: bool, loop: bool = False) -> list[dict]:
    """Step the workload; one record per step: phase times (s), token counts, per-layer times.

    `loop`: the CPU Llama's layers called from Python one by one, not as one C call (cpu/forward.c)."""
    engine = LLMEngine(EngineConfig(**config), loaded=loaded)
    if loop and getattr(engine.runner.model, "one_call", None) is not None:
        engine.runner.model.one_call = None
    timer = Timer()
    per_layer, handles = instrument(engine, timer)
    if events_on:
        state = {"view": None}
        engine.subscribe(lambda e: state.__setitem__("view", fold(state["view"], e)))
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    records = []
    while engine.has_unfinished_requests() and len(records) < steps:
        timer.rec = defaultdict(float)
        n_layer_records = len(per_layer)
        t0 = time.perf_counter()
        result = engine.step()
        total = time.perf_counter() - t0
        r = dict(timer.rec)
        layers = per_layer[-1] if len(per_layer) > n_layer_records else []
        rec = {p: 0.0 for p in PHASES}
        layer_total = sum(t for t, _ in layers)
        rec.update(schedule=r.get("schedule", 0), prepare=r.get("prepare", 0), sample=r.get("sample", 0),
                   events=r.get("events", 0), attention=sum(a for _, a in layers))
        rec["layers (no attention)"] = layer_total - rec["attention"]
        if "one call" in r:      # the layers ran as one C call: attention inside it, not timed apart
            layer_total = r["one call"]
            rec["layers (no attention)"] = layer_total
        rec["embed + norm + LM head"] = r.get("forward", 0) - layer_total
        rec["postprocess"] = total - sum(rec[p] for p in PHASES)
        records.append({"phases": rec, "total": total, "prefill": result.stats.num_prefill_tokens,
                        "decode": result.stats.num_decode_tokens, "layers": layers})
    for h in handles:
        h.remove()
    return records


def classify(rec: dict, max_batch: int) -> str:
    if rec["prefill"] >= 64:
        return "prefill-heavy"
    if rec["decode"] >= max_batch:
        return f"decode, batch {max_batch}"
    return "decode, smaller batch"


def summarise(records: list[dict], max_batch: int) -> dict[str, dict]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for rec in records[1:]:      # the first step warms caches up
        groups[classify(rec, max_batch)].append(rec)
    out = {}
    for kind, recs in groups.items():
        out[kind] = {"steps": len(recs), "total_ms": 1e3 * statistics.mean(r["total"] for r in recs),
                     "tokens": statistics.mean(r["prefill"] + r["decode"] for r in recs),
                     "phases_ms": {p: 1e3 * statistics.mean(r["phases"][p] for r in recs) for p in PHASES},
                     "layers_ms": [(1e3 * statistics.mean(r["layers"][i][0] for r in recs if r["layers"]),
                                    1e3 * statistics.mean(r["layers"][i][1] for r in recs if r["layers"]))
                                   for i in range(len(recs[0]["layers"]))]}
    return out


def bookkeeping(summary: dict) -> tuple[float, float]:
    """(ms, share of the step) spent outside the model: schedule + postprocess + events."""
    ph = summary["phases_ms"]
    ms = ph["schedule"] + ph["postprocess"] + ph["events"]
    return ms, ms / summary["total_ms"]


def plot(summary_off: dict, summary_on: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary_on)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.35, 1]})
    colors = plt.get_cmap("tab10").colors
    for row, kind in enumerate(kinds):
        left = 0.0
        total = summary_on[kind]["total_ms"]
        for j, p in enumerate(PHASES):
            w = summary_on[kind]["phases_ms"][p] / total * 100
            ax.barh(row, w, left=left, color=colors[j], label=p if row == 0 else None)
            if w > 6:
                ax.text(left + w / 2, row, f"{w:.0f}%", ha="center", va="center", fontsize=8, color="white")
            left += w
    ax.set_yticks(range(len(kinds)),
                  [f"{k}\n{summary_on[k]['tokens']:.0f} tokens, {summary_on[k]['total_ms']:.0f} ms" for k in kinds],
                  fontsize=8)
    ax.set_xlabel("share of the step (%), events on")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    kind = next((k for k in kinds if k.startswith("decode, batch")), kinds[0])
    layers = summary_on[kind]["layers_ms"]
    x = range(len(layers))
    ax2.bar(x, [a for _, a in layers], color=colors[2], label="attention")
    ax2.bar(x, [t - a for t, a in layers], bottom=[a for _, a in layers], color=colors[3], label="rest of the layer")
    ax2.legend(fontsize=7)
    ax2.set_xlabel("layer")
    ax2.set_ylabel("ms")
    ax2.set_title(f"forward by layer ({kind})", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="steps profiled per run (the first is dropped)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="EngineConfig field")
    ap.add_argument("--out", default=str(Path(__file__).parent.parent / "docs" / "img" / "step_profile.png"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--loop", action="store_true",
                    help="CpuLlama's Python loop over the layers instead of one C call (cpu/forward.c)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, DTYPES[args.dtype], seed=0)
    reqs = workload(args.num_requests, loaded.model.config.vocab_size, 0)
    config = dict(model=args.model, dtype=args.dtype, block_size=16, num_blocks=1024, max_num_seqs=32,
                  max_num_batched_tokens=512)
    for kv in args.set:
        key, value = kv.split("=", 1)
        config[key] = json.loads(value) if value[:1] in "0123456789-tfn[{\"" else value
    config = current_names(config)          # (older names read too: fast_paths=false is path=reading)
    print(f"model {args.model}, {args.dtype}, torch threads: {torch.get_num_threads()}, config {config}")
    run(loaded, reqs[:4], config, 3, events_on=False)          # warm-up
    off = summarise(run(loaded, reqs, config, args.steps, events_on=False, loop=args.loop), args.num_requests)
    on = summarise(run(loaded, reqs, config, args.steps, events_on=True, loop=args.loop), args.num_requests)
    for label, summary in (("events off", off), ("events on (a subscriber folds every event)", on)):
        print(f"\n{label}: mean ms per step")
        print(f"  {'step kind':24s} {'steps':>5s} {'total':>8s} " + " ".join(f"{p[:11]:>11s}" for p in PHASES))
        for kind, s in summary.items():
            print(f"  {kind:24s} {s['steps']:5d} {s['total_ms']:8.1f} "
                  + " ".join(f"{s['phases_ms'][p]:11.2f}" for p in PHASES))
    print("\nbookkeeping outside the model (schedule + postprocess + events) per step:")
    for kind in on:
        if kind in off:
            (ms_off, sh_off), (ms_on, sh_on) = bookkeeping(off[kind]), bookkeeping(on[kind])
            print(f"  {kind:24s} events off {ms_off:7.2f} ms ({100 * sh_off:4.1f} %)   "
                  f"events on {ms_on:7.2f} ms ({100 * sh_on:4.1f} %)")
    if not args.no_plot:
        plot(off, on, Path(args.out), f"{args.model}, {args.dtype}, torch threads: {torch.get_num_threads()}, "
             f"{config.get('path', 'fast')} path, batch of {args.num_requests}")


if __name__ == "__main__":
    main()
