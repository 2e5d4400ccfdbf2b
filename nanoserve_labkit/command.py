"""`nanoserve lab list | start | check | grade`: the command line of the labs.

    nanoserve lab list
    nanoserve lab start block-pool              writes ./block-pool/block_pool.py and README.md
    nanoserve lab start block-pool --mode design   the same file with the contracts only, no step-by-step TODOs
    nanoserve lab check block-pool              checks ./block-pool/block_pool.py (or a FILE you name)
    nanoserve lab grade block-pool submissions/ one row per .py file, a table and submissions/grades.csv
                                                (each file checked apart: grade.py)

`check` exits 0 only when every check passes (1 otherwise), and then asks the
lab's "why" questions; `--fail-fast` stops at the first failing check and
`--json` prints one JSON object per check instead of the table (the mutation
runs use both). Bad input is a FieldError, which `cli.py` prints as one line
with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from nanoserve.errors import FieldError


def add_lab_parser(sub) -> argparse.ArgumentParser:
    lab = sub.add_parser("lab", help="exercises: write a part of the engine, the real engine checks it",
                         description="Labs: each names one component of the engine. `start` writes a starter "
                                     "made from the engine's own module, `check` runs the real engine with "
                                     "your file plugged in and prints what passes, with hints.")
    acts = lab.add_subparsers(dest="lab_command", metavar="ACTION", required=True)
    acts.add_parser("list", help="the labs: what you implement, prerequisites, rough time")
    start = acts.add_parser("start", help="write a lab's starter file and README into DIR (NAME capstone: a "
                                          "capstone folder of the labs you have done here)")
    start.add_argument("name", metavar="NAME")
    start.add_argument("dir", nargs="?", default=None, metavar="DIR", help="(default: ./NAME)")
    start.add_argument("--mode", choices=("guided", "design"), default="guided",
                       help="guided (default, for a first lab): a TODO that says how, in every body; "
                            "design: each body's contract and the invariants only, the how is yours")
    check = acts.add_parser("check", help="run every check of a lab against your file")
    check.add_argument("name", metavar="NAME")
    check.add_argument("file", nargs="?", default=None, metavar="FILE",
                       help="(default: the starter's path under ./NAME)")
    check.add_argument("--time-limit", type=float, default=None, metavar="S",
                       help="seconds each check may run (default: each check's own limit)")
    check.add_argument("--fail-fast", action="store_true", help="stop at the first check that does not pass")
    check.add_argument("--json", action="store_true", help="one JSON object per check instead of the table")
    grade = acts.add_parser("grade", help="check every .py file in DIR; a table and DIR/grades.csv (NAME capstone: "
                                          "every folder in DIR is a student's capstone)")
    grade.add_argument("name", metavar="NAME")
    grade.add_argument("dir", metavar="DIR")
    grade.add_argument("--csv", default=None, metavar="FILE", help="(default: DIR/grades.csv)")
    grade.add_argument("--time-limit", type=float, default=None, metavar="S",
                       help="seconds each check may run (default: each check's own limit)")
    cap = acts.add_parser("capstone", help="every part you wrote, at once, is the engine: judged against the "
                                           "reference step by step (DIR holds your files from the labs)")
    cap.add_argument("dir", metavar="DIR")
    cap.add_argument("--model", default="tiny-llama", help="the model both engines run (default: tiny-llama)")
    cap.add_argument("--time-limit", type=float, default=600.0, metavar="S",
                     help="seconds one scenario may run with your engine (default: 600)")
    cap.add_argument("--json", action="store_true", help="the report as one JSON object instead of the tables")
    cap.add_argument("--html", default=None, metavar="FILE", help="also write the report as a page to keep")
    return lab


def lab_capstone(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from nanoserve.labs.capstone import PARTS, SCENARIOS
    from nanoserve.models.resolve import TINY_MODELS
    from nanoserve_labkit.capstone import judge, table

    if not Path(args.dir).is_dir():
        raise FieldError("DIR", f"{args.dir} is not a folder (it holds your files from the labs)")
    _check_limit(args.time_limit)
    console = Console(stderr=args.json)
    with Progress(console=console, transient=True, disable=args.json) as bar:
        real = args.model not in TINY_MODELS      # (a real model adds the parity with Hugging Face)
        task = bar.add_task("your parts' rules, the scenarios, the state machine",
                            total=len(PARTS) + len(SCENARIOS) + 1 + real)
        report = judge(args.dir, args.model, time_limit_s=args.time_limit,
                       progress=lambda name, result: bar.advance(task))
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        for t in table(report):
            console.print(t)
        console.print(report.verdict())
    if args.html:
        from nanoserve_labkit.capstone import html_page
        Path(args.html).write_text(html_page(report))
        console.print(f"nanoserve: wrote {args.html}")
    return 0 if report.passed else 1


def capstone_start(args) -> int:
    """`lab start capstone [DIR]`: a capstone folder made of the labs done here (./LAB/FILE, as `lab start`
    writes them); the parts not written yet are listed (they will run the reference)."""
    import shutil

    from nanoserve.labs import get_lab
    from nanoserve.labs.capstone import PARTS

    folder = Path(args.dir if args.dir is not None else "capstone")
    if folder.exists() and any(folder.iterdir()):
        raise FieldError("DIR", f"{folder} exists and is not empty; nothing was overwritten (pick another DIR)")
    found, missing = [], []
    for name in PARTS:
        lab = get_lab(name)
        source = Path(name) / lab.file_name
        if source.is_file():
            (folder / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(source, folder / name / lab.file_name)
            found.append(name)
        else:
            missing.append(name)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"nanoserve: {folder} holds your {len(found)} part(s): {', '.join(found) or 'none yet'}")
    if missing:
        print(f"not written yet (the reference's part runs, marked so): {', '.join(missing)}; "
              f"start one with  nanoserve lab start NAME")
    print(f"next: nanoserve lab capstone {folder}")
    return 0


def capstone_grade(args) -> int:
    """`lab grade capstone DIR`: every folder in DIR is one student's capstone; a table and a CSV."""
    import csv

    from rich.console import Console
    from rich.table import Table

    from nanoserve_labkit.capstone import judge

    root = Path(args.dir)
    if not root.is_dir():
        raise FieldError("DIR", f"{root} is not a folder of capstone folders")
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise FieldError("DIR", f"{root} holds no folders (one capstone folder per student)")
    console = Console(stderr=True)
    rows = []
    for folder in folders:
        console.print(f"judging {folder.name} ...")
        report = judge(folder, time_limit_s=args.time_limit or 600.0)
        ratio = report.throughput_ratio
        rows.append({"submission": folder.name, "parts_yours": len(report.yours),
                     "rules_held": sum(p == t for p, t, _ in report.rules.values()),
                     "scenarios_passed": sum(s.passed for s in report.scenarios),
                     "scenarios": len(report.scenarios), "passed": report.passed,
                     "throughput_ratio": f"{ratio:.2f}" if ratio else "",
                     "identical": "; ".join(f"{lab}: {', '.join(q)}" for lab, q in report.identical.items() if q),
                     "verdict": report.verdict()})
    out = Path(args.csv) if args.csv else root / "grades.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = Table(title=f"capstone grades: {root}")
    for col in ("submission", "parts yours", "scenarios", "verdict"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["submission"], str(r["parts_yours"]), f"{r['scenarios_passed']}/{r['scenarios']}",
                      r["verdict"])
    Console().print(table)
    print(f"nanoserve: wrote {out}")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    # Triton on a CPU runs under its interpreter, which must be on before triton is first imported (loading a
    # model imports it); no lab needs compiled Triton, and the triton-decode lab's engine uses the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return {"list": lab_list, "start": lab_start, "check": lab_check, "grade": lab_grade,
            "capstone": lab_capstone}[args.lab_command](args)


def lab_list(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from nanoserve.labs import get_lab, lab_names
    table = Table(title="nanoserve labs (start one: nanoserve lab start NAME)")
    table.add_column("name", no_wrap=True)
    for col in ("what you implement", "file", "prerequisites", "time"):
        table.add_column(col)
    for name in lab_names():
        lab = get_lab(name)
        table.add_row(name, lab.title, lab.file_name, lab.prerequisites, f"~{lab.minutes} min")
    Console().print(table)
    return 0


def readme(lab, mode: str = "guided", path: Path | None = None) -> str:
    """The lab's README; its commands name `path` (the starter file, absolute: they work from any folder)."""
    file = shlex.quote(str(path)) if path is not None else lab.file_name
    checks = "\n".join(f"{i}. {c.name}" for i, c in enumerate(lab.checks, 1))
    texts = lab.contracts if mode == "design" else lab.blanks
    todo = "\n".join(f"- `{q}`: {texts.get(q, lab.blanks[q])}" for q in lab.blanks)
    rules = f"\n\nWhat must hold between calls:\n\n{lab.invariants.strip()}" if mode == "design" and lab.invariants \
        else ""
    return (f"# Lab {lab.name}: {lab.title}\n\n{lab.intro.strip()}\n\n"
            f"Your file: `{lab.file_name}`, made from the engine's `{lab.module}`. Write these bodies:\n\n"
            f"{todo}{rules}\n\nCheck your work (exit code 0 when everything passes):\n\n"
            f"    nanoserve lab check {lab.name} {file}\n\n"
            f"Watch it run in the real engine:\n\n    nanoserve tui --lab {lab.name}={file}\n\n"
            f"The checks:\n\n{checks}\n\nPrerequisites: {lab.prerequisites}. Rough time: {lab.minutes} minutes.\n")


def lab_start(args) -> int:
    from nanoserve.labs import get_lab
    from nanoserve.labs.starter import starter_source

    if args.name == "capstone":
        return capstone_start(args)

    lab = get_lab(args.name)
    folder = Path(args.dir if args.dir is not None else args.name)
    if folder.exists() and not folder.is_dir():
        raise FieldError("DIR", f"{folder} is a file, not a folder")
    targets = {folder / lab.file_name: starter_source(lab, args.mode),
               folder / "README.md": readme(lab, args.mode, (folder / lab.file_name).resolve())}
    present = [str(p) for p in targets if p.exists()]
    if present:
        raise FieldError("DIR", f"{' and '.join(present)} already exist{'s' if len(present) == 1 else ''}; nothing was overwritten "
                                "(pick another DIR, or move your work away first)")
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in targets.items():
        path.write_text(text)
    what = "write each body to its contract" if args.mode == "design" else "fill in the TODOs"
    print(f"nanoserve: wrote {folder / lab.file_name} and {folder / 'README.md'} ({args.mode} mode)\n"
          f"next: {what}, then  nanoserve lab check {lab.name} {folder / lab.file_name}")
    return 0


def lab_check(args) -> int:
    from nanoserve.labs import get_lab
    from nanoserve_labkit.blanks import identical
    from nanoserve_labkit.confine import landlock_abi
    from nanoserve_labkit.integrity import ImportPathWatch, check_installed
    from nanoserve_labkit.report import print_results
    from nanoserve_labkit.run import CheckResult, Status, run_checks

    lab = get_lab(args.name)
    path = Path(args.file if args.file is not None else Path(args.name) / lab.file_name)
    if not path.is_file():
        raise FieldError("FILE", f"{path} does not exist (start the lab with: nanoserve lab start {lab.name})")
    _check_limit(args.time_limit)
    check_installed()
    watch = ImportPathWatch([] if landlock_abi() >= 1 else None)     # (Landlock: the worker cannot write there)
    results = run_checks(lab, path, args.time_limit, fail_fast=args.fail_fast)
    added = watch.remove_added()
    if added:        # (only where the worker is not confined by Landlock: see confine.py)
        text = f"{path.name} wrote into the import path: {', '.join(added)} (removed)"
        results = [CheckResult(r.check, Status.FAIL, text, "", r.function) for r in results]
    if args.json:
        for r in results:
            print(r.to_json())
    else:
        print_results(lab.name, str(path), results)
        print_identical(identical(lab, path))
        if all(r.passed for r in results):
            print_why(lab)
    return 0 if all(r.passed for r in results) else 1


PASS_MEANS = "every rule of the lab holds on these checks"


def print_identical(qualnames: list[str]) -> None:
    """The flag for bodies copied from the engine (graded all the same; `lab grade` puts it in the CSV)."""
    if qualnames:
        print(f"nanoserve: flagged: identical to the engine's code: {', '.join(qualnames)} (your teacher's grade "
              "sheet shows this flag; write these bodies in your own way)")


def print_why(lab) -> None:
    """After a full pass: what it means, and the lab's "why" questions (answers folded on its page)."""
    print(f"nanoserve: {PASS_MEANS}: your {lab.file_name} does what the engine's own does, on every "
          f"scenario the checks run.")
    if lab.why:
        print(f"Now say why (the answers are on the lab's page, folded: docs/labs/{lab.name}.md):")
        for i, (question, _) in enumerate(lab.why, 1):
            print(f"  {i}. {question}")


def _check_limit(seconds: float | None) -> None:
    if seconds is not None and not seconds > 0:
        raise FieldError("time_limit", f"must be a positive number of seconds, got {seconds}")


def lab_grade(args) -> int:
    from rich.console import Console
    from rich.progress import track

    if args.name == "capstone":
        return capstone_grade(args)

    from nanoserve.labs import get_lab
    from nanoserve_labkit.blanks import identical
    from nanoserve_labkit.confine import describe
    from nanoserve_labkit.grade import grade, read_submissions
    from nanoserve_labkit.integrity import check_installed
    from nanoserve_labkit.report import grade_rows, grade_table, write_csv

    lab = get_lab(args.name)
    folder = Path(args.dir)
    if not folder.is_dir():
        raise FieldError("DIR", f"{folder} is not a folder of submissions")
    submissions = read_submissions(folder)      # every file as handed in, before any of them runs
    if not submissions:
        raise FieldError("DIR", f"{folder} holds no .py files")
    _check_limit(args.time_limit)
    check_installed()
    console = Console(stderr=True)
    console.print(f"nanoserve: on this machine, {describe()}", highlight=False, markup=False)
    graded = grade(lab, submissions, args.time_limit,
                   progress=lambda names: track(names, description=f"checking {len(names)} files", console=console))
    same = {name: identical(lab, source=data.decode("utf-8", "replace"))   # bodies copied from the engine
            for name, data in submissions.items()}
    rows = grade_rows(lab, {name: g.results for name, g in graded.items()}, same,
                      {name: g.verdict for name, g in graded.items()})
    out = Path(args.csv) if args.csv else folder / "grades.csv"
    write_csv(rows, out)
    Console().print(grade_table(lab, rows))
    print(f"nanoserve: wrote {out}. A submission that passes all {len(lab.checks)} checks: {PASS_MEANS} "
          "(only the student's code ran; a copy of the engine's is flagged in the column `identical`: see the "
          "teacher's page)")
    return 0
