"""The capstone's state-machine stage, judged: the student's engine's report against the reference's, here.

The judge draws the plan (nanoserve/labs/capstone_fuzz.py: seeded random add / step / abort / fork / evict
operations, then a drain) and sends it to the lab's worker, where the student's engine applies it and reports
each operation's outcome, events, snapshot and what its `check_invariants()` raised, as plain JSON. The
verdict is decided here, from data the student's code cannot make up without running the engine's own code:

* the same plan runs on the reference engine in this process (its invariants checked here); operation by
  operation, the student's events, outcome and snapshot must equal the reference's;
* the student's reported invariant failures fail the stage (a report that hides one still has to match the
  reference's events and snapshots at every operation);
* the student's events, folded as a viewer folds them, must equal the student's snapshot after every
  operation, and the whole stream must pass the trace check (`trace_check`).

The first failure is reported as "operation k (what it was): ..." with the part most likely at fault: the
part whose event differs, or the one whose replacement by the engine's own makes the plan up to k match.
"""

from __future__ import annotations

import json

from nanoserve.labs.capstone_fuzz import CONFIGS, make_plan, run_plan

FUZZ = "state machine"
SEED = 49
OPS_PER_CONFIG = 1500        # x len(CONFIGS): a few thousand operations, about 10 s per engine on one core

_reference_plans: dict = {}  # (seed, ops, config, paged attention's path) -> the reference's run


def describe(op: list) -> str:
    """An operation in a few words."""
    kind = op[0]
    if kind == "add":
        extra = f", beam width {op[3]['beam_width']}" if op[3].get("beam_width") else \
            (f", n={op[3]['n']}" if op[3].get("n", 1) > 1 else "")
        return f"add {op[1]} ({len(op[2])} prompt tokens, max_tokens={op[3]['max_tokens']}{extra})"
    if kind == "step":
        return "step" if op[1] == 1 else f"{op[1]} steps"
    if kind == "evict":
        return f"evict {op[1]} cached blocks"
    return {"abort": "abort a request", "abort_seq": "abort one fork or beam", "fork": "fork a sequence",
            "drain": "drain and clear the prefix cache"}.get(kind, kind)


def _report(text) -> dict:
    """The worker's report, checked to be plain data of `run_plan`'s shape, or ValueError."""
    if not isinstance(text, str):
        raise ValueError("the worker's report is not text")
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError("the worker's report is nested too deeply to read") from None
    ok = isinstance(data, dict) and isinstance(data.get("ops"), list) and isinstance(data.get("synced"), list)
    ok = ok and all(isinstance(o, dict) and isinstance(o.get("outcome"), str) and isinstance(o.get("events"), list)
                    and all(isinstance(e, dict) for e in o["events"]) and isinstance(o.get("snapshot"), dict)
                    and isinstance(o.get("invariants"), str) for o in data["ops"])
    if not ok:
        raise ValueError("the worker's report is not the state machine's operations")
    return data


def _first_key(a: dict, b: dict, prefix: str = "") -> str:
    """The first field (dotted) where two snapshots differ."""
    from nanoserve_labkit.capstone_compare import same
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if not same(x, y):
            if isinstance(x, dict) and isinstance(y, dict):
                return _first_key(x, y, f"{prefix}{k}.")
            return f"{prefix}{k}: yours {str(y)[:80]}, the reference's {str(x)[:80]}"
    return ""


def compare_fuzz(plan: list, want: dict, got: dict, yours: list[str]):
    """(ScenarioResult, index of the failing operation or None): the student's run against the reference's."""
    from nanoserve.engine_state import fold_mismatches
    from nanoserve.fold import fold
    from nanoserve.trace import event_from_dict
    from nanoserve.trace_check import check_trace
    from nanoserve_labkit.capstone_compare import ScenarioResult, _blame, _short, same

    def fail(k: int, text: str, part: str = ""):
        where = f"operation {k} ({describe(plan[k])})" if k < len(plan) else f"operation {k}"
        return ScenarioResult(FUZZ, False, f"{where}: {text}"[:400], part, len(got["ops"])), k

    if not same(want["synced"], got["synced"]):
        return fail(0, "your engine's first snapshot (EngineSynced) is not the reference's", "block-pool")
    try:
        state = None
        for e in got["synced"]:
            state = fold(state, event_from_dict(e))
    except (ValueError, KeyError, TypeError) as exc:
        return fail(0, f"your EngineSynced does not fold: {exc}")
    stream = list(got["synced"])
    for k, w in enumerate(want["ops"]):
        if k >= len(got["ops"]):
            return fail(k, "your engine's report stops before it")
        g = got["ops"][k]
        a, b = w["events"], g["events"]
        if not same(a, b):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if not same(x, y)), min(len(a), len(b)))
            x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
            return fail(k, f"your engine {_short(y, x)}, the reference {_short(x, y)}", _blame(x, y, yours))
        if g["invariants"]:
            return fail(k, f"an invariant broke: {g['invariants']}")
        if w["invariants"]:      # (the reference's own, checked here: never expected)
            return fail(k, f"the reference's invariant broke: {w['invariants']}")
        if g["outcome"].partition(":")[0] != w["outcome"].partition(":")[0]:    # (the type: wording is free)
            return fail(k, f"your engine: {g['outcome']}; the reference: {w['outcome']}")
        if not same(w["snapshot"], g["snapshot"]):
            return fail(k, f"your engine's state differs: {_first_key(w['snapshot'], g['snapshot'])}")
        try:
            for e in b:
                state = fold(state, event_from_dict(e))
        except (ValueError, KeyError, TypeError) as exc:
            return fail(k, f"your events do not fold: {' '.join(str(exc).split())[:200]}")
        bad = fold_mismatches(state, g["snapshot"])
        if bad:
            return fail(k, f"your events, folded, are not your engine's state: {bad[0]}")
        stream += b
    if len(got["ops"]) != len(want["ops"]):
        return fail(len(want["ops"]), "your engine's report has more operations than the plan")
    try:
        check_trace([event_from_dict(e) for e in stream], "your engine's events")
    except (ValueError, KeyError, TypeError) as exc:
        return ScenarioResult(FUZZ, False, " ".join(str(exc).split())[:300], "", len(got["ops"])), None
    return ScenarioResult(FUZZ, True, steps=len(got["ops"])), None


def reference_run(seed: int, num_ops: int, config: str, yours: list[str]) -> tuple[list, dict]:
    """(plan, the reference engine's run of it), kept for the next folder (`lab grade` judges many)."""
    from nanoserve.labs.capstone import reference_components
    from nanoserve.models.loader import load_model
    key = (seed, num_ops, config, "paged-attention" in yours)
    if key not in _reference_plans:
        loaded = load_model("tiny-llama")
        plan = make_plan(seed, num_ops, loaded.model.config.vocab_size)
        _reference_plans[key] = (plan, run_plan(plan, reference_components(yours), loaded, config))
    return _reference_plans[key]


def _run_student(student, plan: list, config: str, without: tuple[str, ...] = ()):
    """(report, None) or (None, the failure as a result row), the plan run in the worker."""
    from nanoserve_labkit.capstone_compare import ScenarioResult, _fault
    from nanoserve_labkit.wire import ChannelBroken, Deadline
    session = student.session
    try:
        session.start(student.limit)
        session.ep.budget_s = None if student.loopback else student.limit
        return _report(session.helper("nanoserve.labs.capstone_fuzz:fuzz_json", str(student.folder), plan,
                                      config, list(without))), None
    except (Deadline, ChannelBroken) as exc:
        session.stop()
        return None, ScenarioResult(FUZZ, False, f"the worker stopped ({type(exc).__name__}: a step that never "
                                    "ends, or a livelock)")
    except ValueError as exc:
        return None, ScenarioResult(FUZZ, False, f"your engine's report: {exc}")
    except Exception as exc:   # noqa: BLE001 -- the student's engine raised outside an operation
        text, part = _fault(exc, student.parts)
        return None, ScenarioResult(FUZZ, False, text, part)
    finally:
        if session.ep is not None:
            session.ep.budget_s = None


def _matches(plan: list, want: dict, got: dict, yours: list[str]) -> bool:
    try:
        return compare_fuzz(plan, want, got, yours)[0].passed
    except (RecursionError, TypeError, ValueError, KeyError, AttributeError):
        return False


def fuzz_stage(student, yours: list[str], seed: int = SEED, num_ops: int | None = None):
    """The stage on every engine of CONFIGS (`num_ops` each, default OPS_PER_CONFIG): the first failure (part
    blamed), or a pass counting operations."""
    from nanoserve_labkit.capstone_compare import ScenarioResult
    num_ops = num_ops or OPS_PER_CONFIG
    total = 0
    for config, _ in CONFIGS:
        plan, want = reference_run(seed, num_ops, config, yours)
        got, failed = _run_student(student, plan, config)
        k = None
        if failed is None:
            try:
                failed, k = compare_fuzz(plan, want, got, yours)
            except (RecursionError, TypeError, ValueError, KeyError, AttributeError) as exc:
                failed = ScenarioResult(FUZZ, False, f"your engine's report does not read: {type(exc).__name__}")
            if failed.passed:
                total += len(got["ops"])
                continue
        failed.detail = f"{config} engine, {failed.detail}"
        if k is not None and len(yours) > 1:
            cut = plan[:k + 1]
            for lab in yours:
                again, bad = _run_student(student, cut, config, (lab,))
                if bad is None and _matches(cut, {**want, "ops": want["ops"][:k + 1]}, again,
                                            [p for p in yours if p != lab]):
                    failed.part = lab
                    failed.detail += f" (with the engine's own {lab} instead of yours, the operations match)"
                    break
        return failed
    return ScenarioResult(FUZZ, True, steps=total)     # (no seconds: not counted in the throughput)
