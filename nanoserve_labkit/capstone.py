"""`nanoserve lab capstone DIR`: every part the student wrote, at once, is the engine; judged against the reference.

Where things run. The student's whole engine (their parts plugged into one
`Components`, `nanoserve/labs/capstone.py`) runs in the lab's worker process,
the same sandboxed worker `lab check` uses, one call per scenario: it returns
the scenario's events and completions as plain JSON text. Nothing else comes
back, so nothing the student's code does can reach the judge's objects. The
verdict is decided here, in the checker, from what the worker reported:

* the reference engine (the engine's own parts) runs the same scenario here;
  the two event streams must be equal step by step (a first difference is
  reported as "step k: your engine X, the reference Y", with the part whose
  event it is);
* the reported events must replay through the trace checker (`trace_check`:
  the engine's state machine, every block and ref count, every queue move);
  a report that does not decode or does not replay fails;
* the completions must equal the reference's;
* the state machine (`capstone_fuzz.py`): thousands of seeded random operations the checker draws, applied
  by the student's engine in the worker, compared operation by operation with the reference's run of the
  same operations here (events, outcome, state), the reported events folded and trace-checked.

A report can be forged only by producing the reference's exact events, i.e.
by running the engine's own code, which the worker withholds during grading.
Throughput is the reference's time over the student's for the same
scenarios, measured here around the worker's call: a report, never a condition.

Why not the checks' way (the engine here, each part a handle in the worker)?
With every part proxied each step makes hundreds of calls over the channel
(measured: benchmarks/capstone_rpc.py), which puts a real model's run far past
the time a capstone may take; one call per scenario costs nothing per step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.labs.capstone import LEFT_OUT, PARTS, SCENARIOS, Part, find_parts, reference_components, run_scenario
from nanoserve_labkit.blanks import PHRASE
from nanoserve_labkit.capstone_compare import ScenarioResult, _fault, _plain, compare


@dataclass(slots=True)
class Report:
    folder: str
    parts: list[Part]
    scenarios: list[ScenarioResult] = field(default_factory=list)
    rules: dict = field(default_factory=dict)        # lab -> (rows passed, rows, first failure) of its own rules
    identical: dict = field(default_factory=dict)    # lab -> the functions whose bodies are the engine's own

    @property
    def rules_hold(self) -> bool:
        return all(passed == total for passed, total, _ in self.rules.values())

    @property
    def yours(self) -> list[str]:
        return [p.lab for p in self.parts if p.path is not None]

    @property
    def matches(self) -> bool:
        return bool(self.scenarios) and all(s.passed for s in self.scenarios)

    @property
    def passed(self) -> bool:
        """Every part the student's and keeping its lab's rules, and every scenario the reference's, step for
        step."""
        return self.matches and self.rules_hold and len(self.yours) == len(PARTS)

    @property
    def throughput_ratio(self) -> float | None:
        ran = [s for s in self.scenarios if s.passed and s.seconds > 0]
        if not ran:
            return None
        return sum(s.reference_seconds for s in ran) / sum(s.seconds for s in ran)

    def part_status(self, lab: str) -> tuple[str, str]:
        """(whose, result) for one part's row."""
        mine = lab in self.yours
        blamed = [s.name for s in self.scenarios if not s.passed and s.part == lab]
        if not mine:
            return "reference (not written yet)", "not yours: never a pass"
        passed, total, text = self.rules.get(lab, (0, 0, ""))
        if passed < total:
            return "yours", f"its rules: {passed}/{total}; {text}"
        if blamed:
            return "yours", "most likely at fault in " + ", ".join(blamed)
        result = "pass" if self.matches else "no difference traced to it"
        same = self.identical.get(lab)
        return "yours", result + (f"; flagged: identical to the engine's code: {', '.join(same)}" if same else "")

    def verdict(self) -> str:
        n, total = len(self.yours), len(PARTS)
        broken = [lab for lab, (p, t, _) in self.rules.items() if p < t]
        if broken:
            return f"capstone not passed: {broken[0]} breaks its lab's rules ({self.rules[broken[0]][2]})"
        failed = [s for s in self.scenarios if not s.passed]
        if failed:
            s = failed[0]
            return f"capstone not passed: {s.name}: {s.detail}" + (f" (most likely: {s.part})" if s.part else "")
        if n < total:
            return (f"partial capstone: {n} of {total} parts are yours and every scenario matches the reference "
                    "(not a pass until every part is yours)")
        ratio = self.throughput_ratio
        speed = f"; throughput {ratio:.2f}x the reference's" if ratio else ""
        return f"capstone passed: every part yours, every scenario the reference's step for step{speed}"

    def to_json(self) -> dict:
        return {"folder": self.folder, "passed": self.passed, "verdict": self.verdict(),
                "parts": {p.lab: {"file": str(p.path) if p.path else None, "status": self.part_status(p.lab)[1]}
                          for p in self.parts},
                "rules": {lab: {"passed": p, "rows": t, "first_failure": x} for lab, (p, t, x) in self.rules.items()},
                "identical": self.identical,
                "scenarios": [{"name": s.name, "passed": s.passed, "detail": s.detail, "part": s.part,
                               "steps": s.steps} for s in self.scenarios],
                "throughput_ratio": self.throughput_ratio}


_reference_runs: dict = {}   # (model, scenario, same attention path as paged-attention's) -> (run, seconds)


_rule_results: dict = {}     # (lab, the file's bytes' hash) -> unit_rows' answer: a file's rules are its own


def unit_rows(part: Part, loopback: bool = False, time_limit_s: float | None = None) -> tuple[int, int, str]:
    """The part's lab's own rules (its checks that judge one function, not its engine runs: the scenarios
    run the engine) on the student's file: (rows passed, rows, the first failure's text or "")."""
    import hashlib
    key = (part.lab, hashlib.sha256(part.path.read_bytes()).hexdigest())
    if key not in _rule_results:
        _rule_results[key] = _unit_rows(part, loopback, time_limit_s)
    return _rule_results[key]


def _unit_rows(part: Part, loopback: bool, time_limit_s: float | None) -> tuple[int, int, str]:
    import dataclasses

    from nanoserve.labs import get_lab
    from nanoserve_labkit.run import run_checks
    lab = get_lab(part.lab)
    rows = tuple(c for c in lab.checks if c.function or c is lab.checks[0])
    results = run_checks(dataclasses.replace(lab, checks=rows), part.path, time_limit_s, fail_fast=True,
                         loopback=loopback)
    first = next((r for r in results if not r.passed), None)
    text = f"{first.check}: {first.detail}" if first is not None else ""
    return sum(r.passed for r in results), len(rows), " ".join(text.split())[:300]


# What the whole engine imports, imported by the worker before the student's files and the audit hook (the
# hook refuses C library loads: transformers' model classes import torch.distributed, which opens libc).
ENGINE_IMPORTS = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama", "nanoserve.engine",
                  "nanoserve.models.loader", "nanoserve.scenarios", "nanoserve.labs.capstone",
                  "nanoserve.labs.capstone_fuzz")


class _Student:
    """The student's engine in the lab's worker: one call per scenario, a JSON report back. The worker withholds
    the engine's own code of every part the student wrote (`blanks.py`), so what it reports was computed by
    the student's parts; a run `without` some parts (to find the part at fault) gets a worker of its own in
    which those parts' engine code is present."""

    def __init__(self, folder: Path, parts: list[Part], model: str, loopback: bool, time_limit_s: float) -> None:
        self.folder, self.parts, self.model, self.limit, self.loopback = folder, parts, model, time_limit_s, loopback
        self.first = next(p for p in parts if p.path is not None)
        self.yours = [p.lab for p in parts if p.path is not None]
        self.session = self._session(())
        self._blame = None          # (without, Session) of the last run without some parts

    def _session(self, without: tuple[str, ...]):
        from nanoserve.labs import get_lab
        from nanoserve_labkit.run import Session
        written = [p for p in self.parts if p.path is not None and p.lab not in without]
        first = written[0] if written else self.first
        lab = get_lab(first.lab)
        lab = dataclasses.replace(lab, worker_imports=(*lab.worker_imports, *ENGINE_IMPORTS))
        others = tuple((get_lab(p.lab), p.path) for p in written[1:])
        return Session(lab, first.path, self.loopback, self.limit, others=others)

    def _session_without(self, without: tuple[str, ...]):
        if not without:
            return self.session
        if self._blame is None or self._blame[0] != without:
            if self._blame is not None:
                self._blame[1].stop()
            self._blame = (without, self._session(without))
        return self._blame[1]

    def run(self, name: str, without: tuple[str, ...] = ()) -> tuple[dict | None, ScenarioResult | None, float]:
        """(report, None, seconds), or (None, the failure, seconds)."""
        from nanoserve_labkit.run import LoadFailed
        from nanoserve_labkit.wire import ChannelBroken, Deadline
        session = self._session_without(tuple(without))
        try:
            session.start(self.limit)
            session.ep.budget_s = None if self.loopback else self.limit
            session.helper("nanoserve.labs.capstone:prepare", str(self.folder), self.model, list(without))
            t0 = time.perf_counter()           # (the scenario alone: the worker's start and the model's load apart)
            text = session.helper("nanoserve.labs.capstone:record_json_one", str(self.folder), name, self.model,
                                  list(without))
            return _plain(text), None, time.perf_counter() - t0
        except LoadFailed as exc:
            return None, ScenarioResult(name, False, str(exc), self.first.lab), 0.0
        except Deadline:
            session.stop()
            return None, ScenarioResult(name, False, f"still running after {self.limit:g} s (stopped): a step that "
                                        "never ends, or a livelock"), 0.0
        except ChannelBroken as exc:
            session.stop()
            return None, ScenarioResult(name, False, f"the worker process ended ({exc})"), 0.0
        except ValueError as exc:
            return None, ScenarioResult(name, False, f"your engine's report: {exc}"), 0.0
        except Exception as exc:   # noqa: BLE001 -- the student's engine raised: name file, line and part
            text, part = _fault(exc, self.parts)
            return None, ScenarioResult(name, False, text, part), 0.0
        finally:
            if session.ep is not None:
                session.ep.budget_s = None

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> tuple[list | None, ScenarioResult | None]:
        """The student's engine's greedy tokens for `prompts` (or the failure as a result row)."""
        from nanoserve_labkit.wire import ChannelBroken, Deadline
        session = self.session
        try:
            session.start(self.limit)
            session.ep.budget_s = None if self.loopback else self.limit
            got = json.loads(session.helper("nanoserve.labs.capstone:greedy_json", str(self.folder), self.model,
                                            prompts, max_tokens))
            if not (isinstance(got, list) and len(got) == len(prompts)):
                raise ValueError("the worker's greedy tokens are not one list per prompt")
            return got, None
        except (Deadline, ChannelBroken) as exc:
            session.stop()
            return None, ScenarioResult(PARITY, False, f"the worker stopped ({type(exc).__name__})")
        except Exception as exc:   # noqa: BLE001 -- the student's engine raised
            text, part = _fault(exc, self.parts)
            return None, ScenarioResult(PARITY, False, text, part)
        finally:
            if session.ep is not None:
                session.ep.budget_s = None

    def stop(self) -> None:
        self.session.stop()
        if self._blame is not None:
            self._blame[1].stop()
            self._blame = None


PARITY = "greedy = Hugging Face"
FUZZ = "state machine"      # (nanoserve_labkit/capstone_fuzz.py: random operations, invariants after each)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Hugging Face `generate`'s greedy tokens for each prompt on the same weights (float32, one at a time)."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def parity(student: _Student, model: str, loaded) -> ScenarioResult:
    """The student's engine's greedy tokens against Hugging Face's on the same weights (a real model only)."""
    from nanoserve.labs.capstone import parity_prompts
    max_tokens = 12
    prompts = parity_prompts(loaded.model.config.vocab_size)
    want = hf_greedy(model, prompts, max_tokens)
    got, failed = student.greedy(prompts, max_tokens)
    if failed is not None:
        return failed
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            k = next((j for j, (a, b) in enumerate(zip(w, g or [])) if a != b), 0)
            return ScenarioResult(PARITY, False, f"prompt {i} ({len(prompts[i])} tokens), token {k}: your engine "
                                  f"{(g or [None])[k:k + 3]}, Hugging Face {w[k:k + 3]}",
                                  "paged-attention" if "paged-attention" in student.yours else "")
    return ScenarioResult(PARITY, True, steps=len(prompts))


def _at_fault(student: _Student, name: str, want: dict, yours: list[str]) -> str:
    """The one part whose replacement by the engine's own makes the scenario match ("" when no single one does)."""
    for lab in yours:
        got, failed, _ = student.run(name, (lab,))
        if failed is None and compare(name, want, got, [p for p in yours if p != lab]).passed:
            return lab
    return ""


def judge(folder: str | Path, model: str = "tiny-llama", scenarios: tuple[str, ...] = SCENARIOS,
          loopback: bool = False, time_limit_s: float = 600.0, progress=None, fail_fast: bool = False,
          rules: bool = True, fuzz: bool = True) -> Report:
    """Each part's own rules, then every scenario with the student's engine (in the worker) and the reference
    (here); the report. (The reference's runs are kept for the next folder: `lab grade` judges many.)"""
    from nanoserve.models.loader import load_model
    from nanoserve.models.resolve import TINY_MODELS, resolve_model_path

    folder = Path(folder).resolve()
    # A real model is read from its converted folder, here and in the worker (whose HOME is its scratch
    # folder: converting there again would be slow, and the worker may not write a file that large).
    model = model if model in TINY_MODELS else resolve_model_path(model)
    parts = find_parts(folder)
    report = Report(str(folder), parts)
    yours = report.yours
    for part in parts:
        if part.path is not None:          # functions copied from the engine: flagged, never failed (teacher.md)
            from nanoserve.labs import get_lab
            from nanoserve_labkit.blanks import identical
            report.identical[part.lab] = identical(get_lab(part.lab), part.path)
        if part.path is not None and rules:
            report.rules[part.lab] = unit_rows(part, loopback)
            if progress is not None:
                progress(part.lab, None)
    loaded = load_model(model)
    reference = reference_components(yours)
    student = _Student(folder, parts, model, loopback, time_limit_s) if yours else None
    try:
        for name in scenarios:
            if fail_fast and (any(not r.passed for r in report.scenarios) or not report.rules_hold):
                break
            key = (model, name, "paged-attention" in yours)
            if key not in _reference_runs:
                t0 = time.perf_counter()
                _reference_runs[key] = (run_scenario(name, reference, model, loaded), time.perf_counter() - t0)
            want, ref_s = _reference_runs[key]
            if student is None:               # nothing written yet: the reference against itself
                result = compare(name, want, want, yours)
                seconds = ref_s
            else:
                got, failed, seconds = student.run(name)
                result = failed or compare(name, want, got, yours)
                if not result.passed and len(yours) > 1 and PHRASE not in result.detail:
                    culprit = _at_fault(student, name, want, yours)
                    if culprit:
                        result.part = culprit
                        result.detail += f" (with the engine's own {culprit} instead of yours, this scenario matches)"
            result.seconds, result.reference_seconds = seconds, ref_s
            report.scenarios.append(result)
            if student is not None and model not in TINY_MODELS:
                student.stop()      # a fresh worker for the next scenario: a real model's engines stay well
                #                     inside the worker's address-space limit one at a time
            if progress is not None:
                progress(name, result)
        if student is not None and fuzz and not (fail_fast and not report.matches):
            from nanoserve_labkit.capstone_fuzz import fuzz_stage
            report.scenarios.append(fuzz_stage(student, yours))     # (on the tiny Llama, whatever `model` is)
            student.stop()
            if progress is not None:
                progress(report.scenarios[-1].name, report.scenarios[-1])
        if student is not None and model not in TINY_MODELS and not (fail_fast and not report.matches):
            report.scenarios.append(parity(student, model, loaded))
            if progress is not None:
                progress(PARITY, report.scenarios[-1])
    finally:
        if student is not None:
            student.stop()
    return report


def table(report: Report):
    """The report as rich tables: one row per part, one per scenario."""
    from rich.table import Table

    parts = Table(title=f"capstone: {report.folder}", show_lines=False)
    for col in ("part", "file", "whose", "result"):
        parts.add_column(col, overflow="fold")
    for p in report.parts:
        whose, result = report.part_status(p.lab)
        parts.add_row(p.lab, p.path.name if p.path else "-", whose, result)
    for lab, why in LEFT_OUT.items():
        parts.add_row(lab, "-", "not in the engine", why)
    runs = Table(title="scenarios (both engines, step by step)")
    for col in ("scenario", "steps", "result"):
        runs.add_column(col, overflow="fold")
    for s in report.scenarios:
        agreed = {PARITY: "the same greedy tokens", FUZZ: "every invariant held; the reference's events and state "
                  "after every operation"}.get(s.name, "same events, same outputs")
        runs.add_row(s.name, str(s.steps), agreed if s.passed else
                     f"{s.detail}" + (f"\nmost likely: {s.part}" if s.part else ""))
    return parts, runs


def html_page(report: Report) -> str:
    """The report as one self-contained page a student can keep: parts, rules, scenarios, the verdict."""
    from html import escape

    def rows(items) -> str:
        return "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in items)

    parts = rows((p.lab, p.path.name if p.path else "-", *report.part_status(p.lab)) for p in report.parts)
    scen = rows((s.name, s.steps, ("every invariant held, the reference's events" if s.name == FUZZ else
                                   "same events, same outputs") if s.passed else s.detail, s.part)
                for s in report.scenarios)
    ratio = report.throughput_ratio
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>nanoserve capstone</title>
<style>body{{font-family:sans-serif;max-width:70em;margin:2em auto}}td,th{{border:1px solid #ccc;padding:.3em .6em;
vertical-align:top}}table{{border-collapse:collapse;margin:1em 0}}</style></head><body>
<h1>nanoserve capstone: {escape(report.folder)}</h1>
<p><b>{escape(report.verdict())}</b></p>
<h2>Parts</h2><table><tr><th>part</th><th>file</th><th>whose</th><th>result</th></tr>{parts}</table>
<h2>Scenarios (your engine and the reference, step by step)</h2>
<table><tr><th>scenario</th><th>steps</th><th>result</th><th>most likely</th></tr>{scen}</table>
<p>Throughput: {f"{ratio:.2f}x the reference's" if ratio else "not measured"} (a report, not a condition).</p>
</body></html>
"""
