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
from nanoserve_labkit.capstone import html_page, judge

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
    assert all(report.part_status(lab) == ("yours", "pass") for lab in PARTS)
    assert report.verdict().startswith("capstone passed") and report.throughput_ratio > 0
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


@pytest.mark.slow
def test_smollm2_greedy_equals_hugging_face_and_a_wrong_attention_does_not(tmp_path):
    from nanoserve_labkit.capstone import PARITY
    (tmp_path / "good").mkdir()
    folder = reference_folder(tmp_path / "good")
    report = judge(folder, model="smollm2", loopback=True, scenarios=(), rules=False)
    assert [(s.name, s.passed) for s in report.scenarios] == [(PARITY, True)], report.scenarios
    lab = get_lab("paged-attention")
    (tmp_path / "bad").mkdir()
    bad = reference_folder(tmp_path / "bad")
    (bad / lab.file_name).write_text(bug_source(lab, bug("paged-attention", "stores_k_only")))
    report = judge(bad, model="smollm2", loopback=True, scenarios=(), rules=False)
    row = report.scenarios[-1]
    assert row.name == PARITY and not row.passed and row.part == "paged-attention", row
