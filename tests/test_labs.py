"""Labs: every lab's checks pass on the engine's own module, fail (with hints, not a crash) on the untouched
starter in both modes, and on each known bug in tests/lab_bugs/ the first failing row names the function that
carries the bug. The checks run through the lab's channel with the worker's side in this process (the same
copies, handles and refusals as a worker process; tests/test_lab_sandbox.py covers the process itself)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from nanoserve.labs import get_lab, lab_names
from nanoserve.labs.load import load_student
from nanoserve.labs.starter import signature_mismatches, starter_source
from nanoserve_labkit.run import Status, run_in_process

sys.path.insert(0, str(Path(__file__).parent / "lab_bugs"))
from make import bug_source, specs  # noqa: E402


def bug_params():
    return [pytest.param(name, bug, id=f"{name}:{bug.name}") for name in lab_names() for bug in specs(name)[0]]


@pytest.mark.parametrize("name", lab_names())
def test_engine_module_passes_every_check(name):
    lab = get_lab(name)
    results = run_in_process(lab, importlib.import_module(lab.module).__file__)
    assert [r.check for r in results if not r.passed] == [], [(r.check, r.detail) for r in results if not r.passed]


@pytest.mark.parametrize("mode", ["guided", "design"])
@pytest.mark.parametrize("name", lab_names())
def test_starter_fails_with_hints_and_keeps_signatures(name, mode, tmp_path):
    lab = get_lab(name)
    path = tmp_path / lab.file_name
    text = starter_source(lab, mode)
    path.write_text(text)
    assert signature_mismatches(lab, load_student(path)) == []
    assert ("# Contract:" in text) == (mode == "design") and ("# TODO:" in text) == (mode == "guided")
    results = run_in_process(lab, path)
    failed = [r for r in results if not r.passed]
    assert len(failed) == len(results) - 1          # everything but the signature check
    for r in failed:
        assert r.hint and "Traceback" not in r.detail
        assert re.match(rf"{re.escape(lab.file_name)}:\d+ in \w+: not written yet", r.detail), r.detail


@pytest.mark.parametrize("name", lab_names())
def test_every_blank_is_judged_and_has_a_known_bug(name):
    lab = get_lab(name)
    judged = {c.function for c in lab.checks}
    bugs = {b.function for b in specs(name)[0]}
    assert set(lab.blanks) <= judged, f"blanks no check names: {set(lab.blanks) - judged}"
    assert set(lab.blanks) <= bugs, f"blanks with no known bug: {set(lab.blanks) - bugs}"
    assert set(lab.contracts) == set(lab.blanks) and lab.invariants and 2 <= len(lab.why) <= 3
    # helpers before callers: checks that judge one function come before the whole-component ones
    kinds = [bool(c.function) for c in lab.checks[1:]]
    assert kinds == sorted(kinds, reverse=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # NaN is the point of one bug
@pytest.mark.parametrize("name,bug", bug_params())
def test_known_bug_first_failing_row_names_its_function(name, bug, tmp_path):
    lab = get_lab(name)
    path = tmp_path / lab.file_name
    path.write_text(bug_source(lab, bug))
    results = run_in_process(lab, path, fail_fast=True)
    failed = [r for r in results if r.status in (Status.FAIL, Status.TIMEOUT)]
    assert failed, f"{bug.name}: every check passed"
    first = failed[0]
    assert first.function == bug.function, (first.check, first.detail)
    assert first.status is Status.FAIL and "Traceback" not in first.detail
    assert bug.hint in first.detail + " " + first.hint, (first.detail, first.hint)


def test_engine_rows_name_the_function_at_fault(tmp_path):
    """A victim re-queued at the back passes the victim rows' scenario but not the engine's: the engine rows
    blame _preempt (where a victim waits), not the victim policy."""
    lab = get_lab("preemption")
    bug = next(b for b in specs("preemption")[0] if b.name == "waits_at_the_back")
    path = tmp_path / lab.file_name
    path.write_text(bug_source(lab, bug))
    rows = [r for r in run_in_process(lab, path) if r.check.startswith("real engine") and not r.passed]
    assert rows
    for r in rows:
        assert "most likely at fault: _preempt" in r.detail and "where a victim waits" in r.hint, (r.detail, r.hint)


def test_an_engine_failure_is_said_in_the_checks_words(tmp_path):
    """A step that raised inside the engine's own code (a state the student's part left) is one line in the
    check's words, with the step; a raise in the student's file is left for the row to name its line."""
    from nanoserve.errors import StepFailed
    from nanoserve.labs.drive import engine_failure
    from nanoserve.labs.lab import CheckFailed

    student = tmp_path / "kv_manager.py"
    student.write_text("def grow(table):\n    return table[5]\n")
    mine = load_student(student)

    def failed(fn):
        try:
            try:
                fn()
            except IndexError as exc:
                raise StepFailed("step 3 failed", ("a",)) from exc
        except StepFailed as exc:
            return exc

    engine_side = failed(lambda: [][1])
    said = engine_failure(engine_side, str(student), 3)
    assert isinstance(said, CheckFailed) and "\n" not in str(said)
    assert str(said).startswith("at step 3 the engine could not go on from the state your component left")
    assert "IndexError" in str(said) and "Traceback" not in str(said)
    assert engine_failure(failed(lambda: mine.grow([])), str(student), 3) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["block-pool", "paged-attention"])
def test_a_sample_of_mutants_is_killed(name, tmp_path, capsys):
    """Every 7th mutant of the lab's bodies (benchmarks/lab_mutation.py runs them all) fails `lab check`,
    unless tests/lab_bugs lists it as equivalent."""
    from nanoserve.cli import main
    from nanoserve_labkit.mutate import mutants

    lab = get_lab(name)
    equivalent = specs(name)[1]
    survivors = []
    for mutant in list(mutants(lab))[::7]:
        path = tmp_path / lab.file_name
        path.write_text(mutant.source)
        if main(["lab", "check", name, str(path), "--fail-fast", "--json"]) == 0 and mutant.key not in equivalent:
            survivors.append(mutant.label)
        capsys.readouterr()
    assert not survivors, survivors
