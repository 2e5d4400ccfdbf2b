"""Every lesson is a runnable script whose asserts check what it teaches: run each one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).resolve().parent.parent / "lessons").glob("*.py"))


def test_there_are_lessons():
    assert LESSONS, "no lessons/*.py found"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_runs(lesson: Path):
    # One intra-op thread: on a busy 2-core machine torch's thread pool can make
    # each tiny step ~100x slower; the lessons check behaviour, not speed.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(lesson)], capture_output=True, text=True,
                          cwd=lesson.parent.parent, env=env, timeout=600)
    assert proc.returncode == 0, f"{lesson.name} exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
