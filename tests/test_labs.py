"""Labs: every lab's checks pass on the engine's own module, fail (with hints, not a crash) on the untouched
starter, and fail on each known-buggy variant in tests/lab_bugs/ with the hint that names its bug."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from nanoserve.labs import get_lab, lab_names
from nanoserve.labs.load import load_student
from nanoserve.labs.run import Status, run_in_process
from nanoserve.labs.starter import signature_mismatches, starter_source

BUGS = Path(__file__).parent / "lab_bugs"


def bug_files():
    return [pytest.param(name, path, id=f"{name}:{path.stem}") for name in lab_names()
            for path in sorted((BUGS / name.replace("-", "_")).glob("*.py"))]


@pytest.mark.parametrize("name", lab_names())
def test_engine_module_passes_every_check(name):
    lab = get_lab(name)
    results = run_in_process(lab, importlib.import_module(lab.module).__file__)
    assert [r.check for r in results if not r.passed] == [], [(r.check, r.detail) for r in results if not r.passed]


@pytest.mark.parametrize("name", lab_names())
def test_starter_fails_with_hints_and_keeps_signatures(name, tmp_path):
    lab = get_lab(name)
    path = tmp_path / lab.file_name
    path.write_text(starter_source(lab))
    assert signature_mismatches(lab, load_student(path)) == []
    results = run_in_process(lab, path)
    failed = [r for r in results if not r.passed]
    assert len(failed) == len(results) - 1          # everything but the signature check
    for r in failed:
        assert r.hint and "Traceback" not in r.detail
        assert re.match(rf"{re.escape(lab.file_name)}:\d+ in \w+: not written yet", r.detail), r.detail


@pytest.mark.parametrize("name", lab_names())
def test_each_lab_has_three_known_bugs(name):
    assert len(list((BUGS / name.replace("-", "_")).glob("*.py"))) >= 3


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # NaN is the point of one bug
@pytest.mark.parametrize("name,path", bug_files())
def test_known_bug_fails_with_its_hint(name, path):
    expected = re.search(r'EXPECT_HINT = "(.*)"', path.read_text()).group(1)
    results = run_in_process(get_lab(name), path)
    failed = [r for r in results if not r.passed]
    assert failed, f"{path.name}: every check passed"
    assert any(expected in r.hint for r in failed), [(r.check, r.detail, r.hint) for r in failed]
    assert all(r.status is Status.FAIL for r in failed)
