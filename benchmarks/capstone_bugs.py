"""Every known bug of tests/lab_bugs/, plugged into an otherwise complete capstone: does the capstone fail, and
does it name the bug's part?

    python benchmarks/capstone_bugs.py                 # every bug of every capstone lab
    python benchmarks/capstone_bugs.py preemption      # one lab's bugs
    python benchmarks/capstone_bugs.py --scenarios-only   # the engine's runs alone (scenarios, state machine;
                                                          # no lab's own rules)

A capstone folder is made of the engine's own modules as the student's files (which pass), with one file
replaced by the bug's (tests/lab_bugs/make.py). The judge runs with the worker's side in this process (the same
channel code; tests/test_capstone.py runs a few through the real worker). Prints one line per bug and a summary:
failed (and named the part), failed (another part named), passed (neither the capstone's scenarios nor its state
machine exercise it).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "lab_bugs"))


def reference_folder(folder: Path) -> None:
    """The engine's own module of every capstone lab, under the starter's file name."""
    from nanoserve.labs import get_lab
    from nanoserve.labs.capstone import PARTS
    for name in PARTS:
        lab = get_lab(name)
        shutil.copy(importlib.import_module(lab.module).__file__, folder / lab.file_name)


def main(argv: list[str]) -> int:
    from make import bug_source, specs  # noqa: PLC0415 -- tests/lab_bugs is not a package

    from nanoserve.labs import get_lab
    from nanoserve.labs.capstone import PARTS
    from nanoserve_labkit.capstone import judge

    flags = [a for a in argv if a.startswith("--")]
    labs = [a for a in argv if not a.startswith("--")] or list(PARTS)
    counts = {"named": 0, "other part": 0, "passed": 0}
    for name in labs:
        lab = get_lab(name)
        for bug in specs(name)[0]:
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                reference_folder(folder)
                (folder / lab.file_name).write_text(bug_source(lab, bug))
                report = judge(folder, loopback=True, fail_fast=True, rules="--scenarios-only" not in flags)
            failed = [s for s in report.scenarios if not s.passed]
            broken = [lab for lab, (p, t, _) in report.rules.items() if p < t]
            if broken:
                kind = "named" if broken[0] == name else "other part"
                said = f"its lab's rules: {report.rules[broken[0]][2][:110]} -> {broken[0]}"
            elif not failed:
                kind, said = "passed", "every rule and every scenario matched"
            else:
                first = failed[0]
                kind = "named" if first.part == name else "other part"
                said = f"{first.name}: {first.detail[:110]} -> {first.part or '(no part)'}"
            counts[kind] += 1
            print(f"{kind:10s} {name}/{bug.name}: {said}", flush=True)
    total = sum(counts.values())
    print(f"{total} bugs: {counts['named']} failed naming their part, {counts['other part']} failed naming another, "
          f"{counts['passed']} passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
