"""The capstone: every lab's part at once is the engine, judged against the reference step by step.

The engine's own modules as the student's files pass; a folder with only some parts is never a pass and says
which parts ran the reference; a known bug plugged into an otherwise complete capstone fails and names its part
(benchmarks/capstone_bugs.py runs every bug). The judge runs here with the worker's side in this process (the
same channel code)."""

from __future__ import annotations

import html
import importlib
import shutil
import sys
from pathlib import Path

import pytest

from nanoserve.components import Components
from nanoserve.labs import get_lab
from nanoserve.labs.capstone import PARTS, find_parts, folder_components, merged_scheduler
from nanoserve.labs.plug import components_from
from nanoserve_labkit.capstone import FUZZ, html_page, judge

sys.path.insert(0, str(Path(__file__).parent / "lab_bugs"))
from make import bug_source, specs  # noqa: E402


def reference_folder(folder: Path, labs=PARTS) -> Path:
    for name in labs:
        lab = get_lab(name)
        shutil.copy(importlib.import_module(lab.module).__file__, folder / lab.file_name)
    return folder


def bug(lab_name: str, bug_name: str):
    return next(b for b in specs(lab_name)[0] if b.name == bug_name)


def test_the_engines_own_modules_pass(tmp_path):
    report = judge(reference_folder(tmp_path), loopback=True)
    assert report.passed, report.verdict()
    assert report.yours == list(PARTS) and all(p == t for p, t, _ in report.rules.values())
    assert all(report.part_status(lab)[1].startswith("pass; flagged: identical to the engine's code: ")
               for lab in PARTS)
    assert all(report.identical[lab] == list(get_lab(lab).blanks) for lab in PARTS), report.identical
    assert report.verdict().startswith("capstone passed") and report.throughput_ratio > 0
    fuzz = next(s for s in report.scenarios if s.name == FUZZ)
    assert fuzz.passed and fuzz.steps > 2000, fuzz      # a few thousand operations, every invariant holding
    page = html_page(report)
    assert html.escape(report.verdict()) in page and all(f"<td>{lab}</td>" in page for lab in PARTS)


def test_a_partial_capstone_is_never_a_pass(tmp_path):
    (tmp_path / "block-pool").mkdir()
    shutil.copy(importlib.import_module("nanoserve.block_pool").__file__, tmp_path / "block-pool" / "block_pool.py")
    report = judge(tmp_path, loopback=True, scenarios=("continuous-batching",))
    assert report.matches and not report.passed
    assert report.yours == ["block-pool"]
    assert report.part_status("radix-cache") == ("reference (not written yet)", "not yours: never a pass")
    assert report.verdict().startswith("partial capstone: 1 of 8 parts")


def test_the_worker_withholds_every_part_the_student_wrote(tmp_path):
    """In the real worker the engine's own code of every written part is withheld, not only the first's: a
    later part that imports the engine's answer fails the scenario, and the part is named."""
    folder = reference_folder(tmp_path)
    (folder / "radix_cache.py").write_text("from nanoserve.radix_cache import *  # noqa: F403\n")
    report = judge(folder, scenarios=("continuous-batching",), rules=False, fuzz=False, time_limit_s=120)
    [result] = report.scenarios
    assert not result.passed and result.part == "radix-cache", (result.detail, result.part)
    assert "this check runs your code" in result.detail and "radix_cache.py takes it from the engine" in result.detail


@pytest.mark.parametrize("lab_name,bug_name,rules", [("block-pool", "mru_allocate", True),
                                                      ("step-commit", "eos_ignored_flag", True),
                                                      ("radix-cache", "match_no_split", False),
                                                      ("preemption", "oldest_victim", False)])
def test_a_known_bug_fails_the_capstone_and_names_its_part(tmp_path, lab_name, bug_name, rules):
    lab = get_lab(lab_name)
    folder = reference_folder(tmp_path)
    (folder / lab.file_name).write_text(bug_source(lab, bug(lab_name, bug_name)))
    report = judge(folder, loopback=True, fail_fast=True, rules=rules)
    assert not report.passed
    if rules:
        broken = [name for name, (p, t, _) in report.rules.items() if p < t]
        assert broken == [lab_name], report.rules
    else:
        first = next(s for s in report.scenarios if not s.passed)
        assert first.part == lab_name and first.detail.startswith("step "), (first.detail, first.part)
    assert lab_name in report.verdict()


@pytest.mark.parametrize("lab_name,bug_name", [("scheduler-budget", "spends_refused_budget"),
                                               ("preemption", "victim_in_batch")])
def test_a_bug_only_the_state_machine_finds_fails_the_capstone_and_names_its_part(tmp_path, lab_name, bug_name):
    """Bugs every scenario misses (a budget spent on a sequence that got no blocks; a victim taken from this
    step's batch: the scenarios' queues never come to that) but the state machine's random operations reach:
    the stage fails at an operation and names the part."""
    lab = get_lab(lab_name)
    folder = reference_folder(tmp_path)
    (folder / lab.file_name).write_text(bug_source(lab, bug(lab_name, bug_name)))
    report = judge(folder, loopback=True, rules=False)
    assert [s.name for s in report.scenarios if not s.passed] == [FUZZ], report.scenarios
    fuzz = report.scenarios[-1]
    assert fuzz.part == lab_name and " engine, operation " in fuzz.detail, (fuzz.detail, fuzz.part)
    assert report.verdict().startswith(f"capstone not passed: {FUZZ}") and lab_name in report.verdict()


def test_the_state_machine_stage_decides_from_the_reference_not_from_the_report(tmp_path):
    """A forged report (the reference's own run with one operation's events changed, every invariant
    claimed to hold) fails: the judge compares with the reference it ran itself, then folds the events."""
    import copy

    from nanoserve.labs.capstone_fuzz import CONFIGS
    from nanoserve_labkit.capstone_fuzz import compare_fuzz, reference_run
    yours = list(PARTS)
    plan, want = reference_run(49, 300, CONFIGS[0][0], yours)
    assert compare_fuzz(plan, want, want, yours)[0].passed
    k = next(i for i, op in enumerate(want["ops"]) if any(e["type"] == "BlocksFreed" for e in op["events"]))
    forged = copy.deepcopy(want)
    forged["ops"][k]["events"] = [e for e in forged["ops"][k]["events"] if e["type"] != "BlocksFreed"]
    result, at = compare_fuzz(plan, want, forged, yours)
    assert not result.passed and at == k and result.detail.startswith(f"operation {k} ("), result.detail
    assert result.part == "block-pool"
    hidden = copy.deepcopy(want)       # a snapshot that hides a leak: the reference's state says otherwise
    hidden["ops"][k]["snapshot"]["pool"]["num_free_blocks"] = -1
    result, at = compare_fuzz(plan, want, hidden, yours)
    assert not result.passed and at == k and "state differs: pool.num_free_blocks" in result.detail, result.detail


def test_scheduler_blanks_come_from_the_lab_that_owns_them(tmp_path):
    from nanoserve.labs.load import load_student
    reference_folder(tmp_path, ("scheduler-budget", "preemption"))
    budget = load_student(tmp_path / "scheduler.py")
    preemption = load_student(tmp_path / "scheduler_preemption.py")
    merged = merged_scheduler(budget, preemption)
    for qualname in get_lab("preemption").blanks:
        name = qualname.split(".", 1)[1]
        assert getattr(merged, name).__code__.co_filename == str(tmp_path / "scheduler_preemption.py")
    for qualname in get_lab("scheduler-budget").blanks:
        name = qualname.split(".", 1)[1]
        assert getattr(merged, name).__code__.co_filename == str(tmp_path / "scheduler.py")


def test_lab_dir_plugs_every_part(tmp_path):
    folder = reference_folder(tmp_path)
    replaced = folder_components(folder).replaced()
    assert set(replaced) == {"block_pool", "radix_cache", "kv_manager", "scheduler", "request_table", "verify",
                             "attention_backend"}
    assert components_from([str(folder)]).replaced().keys() == replaced.keys()
    assert [p.lab for p in find_parts(folder)] == list(PARTS)
    assert isinstance(components_from([str(folder)]), Components)


def test_lab_start_capstone_gathers_the_labs_done_here(tmp_path, monkeypatch, capsys):
    from nanoserve.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cow-fork").mkdir()
    shutil.copy(importlib.import_module("nanoserve.kv_manager").__file__, tmp_path / "cow-fork" / "kv_manager.py")
    assert main(["lab", "start", "capstone", "mine"]) == 0
    out = capsys.readouterr().out
    assert "your 1 part(s): cow-fork" in out and "step-commit" in out
    assert [(p.lab, p.path is not None) for p in find_parts(tmp_path / "mine")][2] == ("cow-fork", True)
    assert main(["lab", "start", "capstone", "mine"]) != 0      # nothing is overwritten


def test_lab_grade_capstone_writes_a_row_per_student(tmp_path, monkeypatch, capsys):
    """`lab grade capstone DIR` through the real sandboxed worker (one scenario and a short state machine, to
    keep it quick): a complete folder passes, a partial one is marked so, one CSV row each."""
    import csv

    import nanoserve_labkit.capstone as capstone
    import nanoserve_labkit.capstone_fuzz as fuzz
    from nanoserve.cli import main
    for name in ("alice", "bob"):
        (tmp_path / name).mkdir()
    reference_folder(tmp_path / "alice")
    reference_folder(tmp_path / "bob", ("block-pool",))
    judge_all = capstone.judge
    monkeypatch.setattr(capstone, "judge", lambda folder, **kw: judge_all(folder, scenarios=("continuous-batching",),
                                                                         **kw))
    monkeypatch.setattr(fuzz, "OPS_PER_CONFIG", 150)
    assert main(["lab", "grade", "capstone", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'grades.csv'}" in capsys.readouterr().out
    rows = {r["submission"]: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert rows.keys() == {"alice", "bob"}
    alice, bob = rows["alice"], rows["bob"]
    assert (alice["passed"], alice["parts_yours"], alice["rules_held"]) == ("True", "8", "8"), alice
    assert alice["scenarios_passed"] == alice["scenarios"] == "2" and alice["verdict"].startswith("capstone passed")
    assert (bob["passed"], bob["parts_yours"], bob["scenarios_passed"]) == ("False", "1", "2"), bob
    assert bob["verdict"].startswith("partial capstone: 1 of 8 parts")
    assert main(["lab", "grade", "capstone", str(tmp_path / "alice" / "block_pool.py")]) != 0
    err = capsys.readouterr().err
    assert "DIR" in err and "not a folder of capstone folders" in err


@pytest.mark.slow
def test_smollm2_greedy_equals_hugging_face_and_a_wrong_attention_does_not(tmp_path):
    from nanoserve_labkit.capstone import PARITY
    (tmp_path / "good").mkdir()
    folder = reference_folder(tmp_path / "good")
    report = judge(folder, model="smollm2", loopback=True, scenarios=(), rules=False, fuzz=False)
    assert [(s.name, s.passed) for s in report.scenarios] == [(PARITY, True)], report.scenarios
    lab = get_lab("paged-attention")
    (tmp_path / "bad").mkdir()
    bad = reference_folder(tmp_path / "bad")
    (bad / lab.file_name).write_text(bug_source(lab, bug("paged-attention", "stores_k_only")))
    report = judge(bad, model="smollm2", loopback=True, scenarios=(), rules=False, fuzz=False)
    row = report.scenarios[-1]
    assert row.name == PARITY and not row.passed and row.part == "paged-attention", row
