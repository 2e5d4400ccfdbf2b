"""Two runs of the same workload, side by side: what differs, and from which step.

    from nanoserve.whatif import compare
    c = compare(run, run.branch(0, preemption_mode="swap"))   # Runs, event lists or trace files
    c                          # in a REPL: a table, A | B | B - A, and the first diverging step
    c.first_divergence         # 7: the first step whose events differ (None: the runs are the same)
    c.difference("swaps")      # B's count minus A's

A `Comparison` is plain data measured from the two traces (`metrics.py`):
whole-run totals (blocks in use, tokens computed, prefix hits, preemptions,
swaps, CoW copies) and, per request, the step of its first token and of its
finish. The first diverging step is found on the events themselves: the
first step whose events differ in anything but the measured wall time.
Events a run emits between steps (a request added after step k) count as
step k's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from nanoserve import events as ev
from nanoserve.whatif.metrics import RunMetrics, measure


@dataclass(slots=True)
class Comparison:
    """Run A against run B: their measurements and the first step where their events differ."""

    a: RunMetrics
    b: RunMetrics
    first_divergence: int | None          # None: the same events at every step
    labels: tuple[str, str] = ("A", "B")
    settings: dict = dataclasses.field(default_factory=dict)   # setting -> (A's value, B's value), where they differ

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def difference(self, name: str) -> int:
        """B - A for one whole-run total (a key of `RunMetrics.totals()`)."""
        return self.b.totals()[name] - self.a.totals()[name]

    def total_rows(self) -> list[tuple[str, int, int]]:
        """(name, A, B) for every whole-run total."""
        a, b = self.a.totals(), self.b.totals()
        return [(name, a[name], b[name]) for name in a]

    def request_rows(self) -> list[tuple[str, tuple, tuple]]:
        """(request id, (A's first-token step, finish step), (B's ...)), requests of either run in order."""
        ids = list(self.a.requests) + [rid for rid in self.b.requests if rid not in self.a.requests]

        def steps(m: RunMetrics, rid: str) -> tuple:
            r = m.requests.get(rid)
            return (None, None) if r is None else (r.first_token_step, r.finish_step)

        return [(rid, steps(self.a, rid), steps(self.b, rid)) for rid in ids]

    # -- showing it ---------------------------------------------------------------------------

    def headline(self) -> str:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.settings.items()) or "the same settings"
        where = (f"first diverge at step {self.first_divergence}" if self.diverged
                 else "no divergence: the same events at every step")
        return f"{self.labels[0]} vs {self.labels[1]} ({what}): {where}"

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table

        totals = Table(title="whole run", title_justify="left")
        for col, justify in (("", "left"), (self.labels[0], "right"), (self.labels[1], "right"),
                             ("B - A", "right")):
            totals.add_column(col, justify=justify)
        for name, a, b in self.total_rows():
            totals.add_row(name, str(a), str(b), _signed(b - a, highlight=True))
        per_request = Table(title="per request (step of the first token / of the finish)", title_justify="left")
        for col in ("request", f"{self.labels[0]} first", f"{self.labels[1]} first",
                    f"{self.labels[0]} finish", f"{self.labels[1]} finish"):
            per_request.add_column(col, justify="left" if col == "request" else "right")
        for rid, (a_first, a_end), (b_first, b_end) in self.request_rows():
            per_request.add_row(rid, _cell(a_first), _cell(b_first, a_first), _cell(a_end), _cell(b_end, a_end))
        return Group(self.headline(), totals, per_request)

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=max(100, len(self.headline())), record=True, file=_Null(), color_system=None)
        console.print(self)
        return console.export_text().rstrip()

    def __repr__(self) -> str:      # a REPL shows the tables, in colour on a terminal (as StepResult does)
        from nanoserve.display import as_text
        return as_text(self.__rich__())

    def _repr_html_(self) -> str:   # Jupyter
        from nanoserve.display import as_html
        return as_html(self.__rich__())


class _Null:
    def write(self, _text) -> None: ...
    def flush(self) -> None: ...


def _signed(n: int, highlight: bool = False) -> str:
    text = f"{n:+d}" if n else "0"
    return f"[bold]{text}[/]" if highlight and n else text


def _cell(value, other=...) -> str:
    """A step number; bold where it differs from `other` (the A side)."""
    text = "-" if value is None else str(value)
    return f"[bold]{text}[/]" if other is not ... and value != other else text


# -- building one ------------------------------------------------------------------------------


def compare(a, b, labels: tuple[str, str] = ("A", "B")) -> Comparison:
    """Compare two runs: each a `Run`, a list of events, or the path of a JSONL trace."""
    events_a, events_b = _events(a), _events(b)
    ma, mb = measure(events_a), measure(events_b)
    settings = {k: (ma.config.get(k), mb.config.get(k)) for k in dict.fromkeys([*ma.config, *mb.config])
                if ma.config.get(k) != mb.config.get(k)}
    return Comparison(ma, mb, first_divergence(events_a, events_b), labels, settings)


def _events(run) -> list[ev.Event]:
    """A Run's events (the engine's own), or a trace's (a path, or a list of events), checked."""
    from nanoserve.trace_check import check_trace, load_trace

    if isinstance(run, (str, Path)):
        return load_trace(run)
    if hasattr(run, "events"):
        return list(run.events)
    events = list(run)
    check_trace(events, "events")
    return events


def first_divergence(a: list[ev.Event], b: list[ev.Event]) -> int | None:
    """The first step whose events differ (wall time aside), or None when every step matches.

    The opening EngineSynced is left out: it states the settings, which differ on purpose.
    """
    steps_a, steps_b = _by_step(a), _by_step(b)
    for (step_a, group_a), (step_b, group_b) in zip(steps_a, steps_b):
        if step_a != step_b or group_a != group_b:
            return min(step_a, step_b)
    if len(steps_a) != len(steps_b):   # one ran longer: it diverges where the shorter stopped
        shorter = steps_a if len(steps_a) < len(steps_b) else steps_b
        return shorter[-1][0] + 1 if shorter else 0
    return None


def _by_step(events: list[ev.Event]) -> list[tuple[int, list[ev.Event]]]:
    plain = [dataclasses.replace(e, duration_s=0.0) if isinstance(e, ev.StepFinished) else e
             for e in events if not isinstance(e, ev.EngineSynced)]
    return [(step, list(group)) for step, group in groupby(plain, key=lambda e: e.step)]
