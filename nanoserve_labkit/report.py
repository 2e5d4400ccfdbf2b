"""Results as a rich table (one student) or a grade sheet with a CSV (a folder of submissions)."""

from __future__ import annotations

import csv
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nanoserve_labkit.run import CheckResult, Status

MARK = {Status.PASS: "[green]pass[/]", Status.FAIL: "[red]fail[/]", Status.TIMEOUT: "[yellow]timeout[/]",
        Status.SKIPPED: "[dim]not run[/]"}


def results_table(lab_name: str, path: str, results: list[CheckResult]) -> Table:
    """check | result | what happened, and what to look at."""
    passed = sum(r.passed for r in results)
    table = Table(title=f"lab {lab_name}: {path}", caption=f"{passed}/{len(results)} checks pass",
                  show_lines=True, expand=False)
    table.add_column("check", max_width=34)
    table.add_column("result", no_wrap=True)
    table.add_column("what happened / hint", max_width=90)
    for r in results:
        # (escaped: an exception's message is the student's text, and may hold [brackets])
        note = "" if r.passed else escape(r.detail) if r.status is Status.SKIPPED else \
            f"{escape(r.detail)}\n[dim]hint:[/] {escape(r.hint)}"
        table.add_row(escape(r.check), MARK[r.status], note)
    return table


def print_results(lab_name: str, path: str, results: list[CheckResult], console: Console | None = None) -> None:
    (console or Console()).print(results_table(lab_name, path, results))


def grade_rows(lab, submissions: dict[str, list[CheckResult]], identical: dict[str, list[str]] | None = None,
               verdicts: dict[str, str] | None = None) -> list[dict]:
    """One row per submission: file, passed, total, the blanks whose bodies are identical to the engine's
    (`blanks.identical`, space-separated), then pass/fail/timeout for every check, then how its checking
    ended ("checked", or "stopped its checker (SIGKILL)" and the like: grade.py)."""
    rows = []
    for name, results in submissions.items():
        row = {"submission": name, "passed": sum(r.passed for r in results), "total": len(results),
               "identical": " ".join((identical or {}).get(name, []))}
        row.update({c.name: r.status.value for c, r in zip(lab.checks, results)})
        row["verdict"] = (verdicts or {}).get(name, "checked")
        rows.append(row)
    return rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["submission", "passed", "total"])
        writer.writeheader()
        writer.writerows(rows)


def grade_table(lab, rows: list[dict]) -> Table:
    table = Table(title=f"lab {lab.name}: {len(rows)} submissions", show_lines=False)
    table.add_column("submission")
    table.add_column("passed", justify="right")
    table.add_column("identical")
    for i, _ in enumerate(lab.checks, 1):
        table.add_column(str(i), justify="center")
    for row in rows:
        marks = [MARK[Status(row[c.name])].replace("pass", "✓").replace("fail", "✗").replace("timeout", "⏱")
                 .replace("not run", "·")
                 for c in lab.checks]
        table.add_row(row["submission"], f"{row['passed']}/{row['total']}", "copied" if row["identical"] else "",
                      *marks)
    table.caption = "  ".join(f"{i}: {c.name}" for i, c in enumerate(lab.checks, 1))
    for row in rows:
        if row.get("verdict", "checked") != "checked":
            table.caption += f"\n{escape(row['submission'])}: {escape(row['verdict'])}"
    return table
