"""Figures of a run, drawn with matplotlib from its trace (headless: the Agg backend).

    nanoserve plot --trace pressure.jsonl --what blocks -o blocks.png
    figure(run, "timeline")                  # a Run, events, a trace path ... or a Comparison:
    figure(compare(a, b), "blocks")          # the two runs side by side, same axes

Five figures, each split into the numbers it shows (`data`, checked by
tests/test_whatif_plots.py against the engine) and the drawing (`draw`):

* `blocks`    device blocks after each step: used, cached (evictable), free;
              CPU blocks holding swapped-out KV as a dashed line
* `timeline`  one row per request, one cell per step: waiting, prefill, decode,
              idle (no budget left), preempted, swapped
* `tokens`    tokens computed per step, prefill and decode stacked
* `latency`   time to first token and inter-token latency, in measured ms
* `grammar`   structured output: per constrained request, how many tokens its
              grammar's mask allowed at each output token (log scale), forced
              tokens (one allowed) marked

matplotlib is imported only when a figure is drawn, so `nanoserve --help`
stays instant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanoserve.whatif.metrics import PHASES, RunMetrics, measure

# Blocks (blocks figure) and request phases (timeline) share names where they mean the same thing.
COLOURS = {"used": "#4c72b0", "cached": "#55a868", "free": "#dddddd", "swapped": "#8172b3",
           "prefill": "#dd8452", "decode": "#4c72b0", "waiting": "#eeeeee", "idle": "#bbbbbb",
           "preempted": "#c44e52", "ttft": "#dd8452", "itl": "#4c72b0"}


def blocks_data(m: RunMetrics) -> dict[str, list]:
    return {"step": [s.step for s in m.steps], "used": [s.used for s in m.steps],
            "cached": [s.cached for s in m.steps], "free": [s.free for s in m.steps],
            "swapped": [s.swapped for s in m.steps]}


def draw_blocks(ax, d: dict, m: RunMetrics) -> None:
    ax.stackplot(d["step"], d["used"], d["cached"], d["free"], labels=["used", "cached", "free"],
                 colors=[COLOURS["used"], COLOURS["cached"], COLOURS["free"]], step="post")
    if any(d["swapped"]):
        ax.step(d["step"], d["swapped"], where="post", color=COLOURS["swapped"], linestyle="--",
                label="swapped (CPU blocks)")
    ax.set(xlabel="step", ylabel="blocks", ylim=(0, max([m.num_blocks, *d["swapped"]]) + 1))
    ax.legend(loc="upper right", fontsize="small")


def timeline_data(m: RunMetrics) -> dict[str, dict[int, str]]:
    """Request id -> {step: phase}."""
    return {rid: dict(r.phases) for rid, r in m.requests.items() if r.phases}


def draw_timeline(ax, d: dict, m: RunMetrics) -> None:
    rows = list(d)
    for y, rid in enumerate(rows):
        for phase in PHASES:
            cells = [(step - 0.5, 1) for step, p in d[rid].items() if p == phase]
            if cells:
                ax.broken_barh(cells, (y - 0.4, 0.8), color=COLOURS[phase], edgecolor="white", linewidth=0.3)
        finish = m.requests[rid].finish_step
        if finish is not None:
            ax.plot(finish + 0.5, y, marker="|", color="black", markersize=10)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set(xlabel="step")
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=COLOURS[p], label=p) for p in PHASES],
              loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=len(PHASES), fontsize="small")


def tokens_data(m: RunMetrics) -> dict[str, list]:
    return {"step": [s.step for s in m.steps], "prefill": [s.prefill_tokens for s in m.steps],
            "decode": [s.decode_tokens for s in m.steps]}


def draw_tokens(ax, d: dict, m: RunMetrics) -> None:
    ax.bar(d["step"], d["prefill"], color=COLOURS["prefill"], label="prefill")
    ax.bar(d["step"], d["decode"], bottom=d["prefill"], color=COLOURS["decode"], label="decode")
    budget = m.config.get("max_num_batched_tokens")
    if budget:
        ax.axhline(budget, color="black", linewidth=0.8, linestyle=":", label="token budget")
        ax.set_ylim(0, 1.15 * max([budget, *(p + q for p, q in zip(d["prefill"], d["decode"]))]))
    ax.set(xlabel="step", ylabel="tokens computed")
    ax.legend(loc="upper right", fontsize="small")


def latency_data(m: RunMetrics) -> dict[str, list[float]]:
    return {"ttft_ms": [1000 * t for t in m.ttft_s().values()], "itl_ms": [1000 * t for t in m.itl_s()]}


def draw_latency(ax, d: dict, m: RunMetrics) -> None:
    values = [d["ttft_ms"], d["itl_ms"]]
    ax.hist(values, bins=20, label=["time to first token", "inter-token latency"],
            color=[COLOURS["ttft"], COLOURS["itl"]])
    ax.set(xlabel="ms (measured)", ylabel="count")
    ax.legend(loc="upper right", fontsize="small")


def grammar_data(m: RunMetrics) -> dict[str, list[tuple[int, bool, bool]]]:
    """Sequence id -> (tokens allowed, forced, top choice masked) per constrained output token."""
    return {rid: list(r.masks) for rid, r in m.requests.items() if r.masks}


def draw_grammar(ax, d: dict, m: RunMetrics) -> None:
    if not d:
        ax.text(0.5, 0.5, "no structured output in this trace", ha="center", va="center", transform=ax.transAxes)
        return
    for rid, masks in d.items():
        allowed = [n for n, _, _ in masks]
        line, = ax.step(range(1, len(allowed) + 1), allowed, where="mid", label=rid)
        forced = [i + 1 for i, (_, f, _) in enumerate(masks) if f]
        ax.plot(forced, [1] * len(forced), "o", ms=3, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("output token (dots: forced, 1 allowed)")
    ax.set_ylabel("tokens the mask allowed")
    ax.legend(loc="upper right", fontsize="small")


@dataclass(frozen=True, slots=True)
class Figure:
    title: str
    data: Callable[[RunMetrics], dict]
    draw: Callable


FIGURES = {
    "blocks": Figure("device blocks in use over steps (used, cached, free; swapped on the CPU)", blocks_data,
                     draw_blocks),
    "timeline": Figure("what each request does at each step", timeline_data, draw_timeline),
    "tokens": Figure("tokens computed per step, prefill and decode", tokens_data, draw_tokens),
    "latency": Figure("time to first token and inter-token latency", latency_data, draw_latency),
    "grammar": Figure("structured output: tokens each grammar's mask allowed", grammar_data, draw_grammar),
}


def figure(source, what: str):
    """A matplotlib Figure of `what` for a run (a Run, events or a trace path) or a Comparison."""
    import matplotlib
    matplotlib.use("Agg")                 # headless: no display needed, and none is touched
    from matplotlib.figure import Figure as MplFigure

    from nanoserve.whatif.compare import Comparison, _events

    if what not in FIGURES:
        raise ValueError(f"unknown figure {what!r}; choose one of: {', '.join(FIGURES)}")
    spec = FIGURES[what]
    if isinstance(source, Comparison):
        panels = [(source.labels[0], source.a), (source.labels[1], source.b)]
    else:
        panels = [("", measure(_events(source)))]
    rows = max(len(m.requests) for _, m in panels) if what == "timeline" else 0
    fig = MplFigure(figsize=(6.4 * len(panels), 3.2 + 0.25 * rows), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=what != "timeline")[0]
    for ax, (label, metrics) in zip(axes, panels):
        spec.draw(ax, spec.data(metrics), metrics)
        if label:
            ax.set_title(label)
    fig.suptitle(spec.title)
    return fig


def render(source, what: str, fmt: str = "svg") -> bytes:
    """The figure as PNG or SVG bytes. The same run gives the same bytes (no date stamp, fixed
    SVG ids), so a picture in the docs can be checked against a fresh run."""
    import io

    import matplotlib

    fig = figure(source, what)
    buf = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.hashsalt": "nanoserve"}):
        fig.savefig(buf, format=fmt, dpi=110, metadata=metadata)
    return buf.getvalue()


def save_figure(source, what: str, path: str | Path):
    """Draw `what` and write it to `path` (.png or .svg, by its suffix); returns the path."""
    path = Path(path)
    path.write_bytes(render(source, what, path.suffix.lower().lstrip(".") or "png"))
    return path
