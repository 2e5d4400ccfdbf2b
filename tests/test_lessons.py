"""Every lesson is a runnable script whose asserts check what it teaches: run each one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.py"))


def test_there_are_lessons():
    assert LESSONS, "no lessons/*.py found"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_has_a_docs_page_in_the_nav(lesson: Path):
    """Each lesson is included whole by a page under docs/lessons/, and that page is in mkdocs.yml's nav."""
    include = f'--8<-- "lessons/{lesson.name}"'
    pages = [p for p in sorted((ROOT / "docs" / "lessons").glob("*.md")) if include in p.read_text()]
    assert pages, f"no docs/lessons/*.md includes {lesson.name}"
    nav = (ROOT / "mkdocs.yml").read_text()
    assert f"lessons/{pages[0].name}" in nav, f"{pages[0].name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_runs(lesson: Path):
    # One intra-op thread: on a busy 2-core machine torch's thread pool can make
    # each tiny step ~100x slower; the lessons check behaviour, not speed.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(lesson)], capture_output=True, text=True,
                          cwd=lesson.parent.parent, env=env, timeout=600)
    assert proc.returncode == 0, f"{lesson.name} exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
