"""A real browser for the tests: playwright driving Debian's Chromium (never a downloaded one).

`needs_browser` skips a test, with the reason, where /usr/bin/chromium or the
playwright package is missing (CI installs both: `apt-get install chromium`
in .ci/run, playwright in the dev extra). `screen_text` reads a Textual SVG
screenshot back as rows of text, and `block_tables` / `free_count` read two
panels of the TUI off those rows, as a student reads them off the screen.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox (CI runs as root in a container), no GPU, and nothing that phones home.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]

needs_browser = pytest.mark.skipif(
    not CHROMIUM.exists() or importlib.util.find_spec("playwright") is None,
    reason="needs Debian's chromium (apt-get install chromium) and playwright (pip install '.[dev]')",
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
from docgen.pictures import screen_lines  # noqa: E402  (the docs' reader of TUI screenshots)


def launch(playwright):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)


def screen_text(svg: str) -> list[str]:
    """The rows of a TUI screenshot (title first)."""
    return screen_lines(svg)


def panel(rows: list[str], title: str) -> list[str]:
    """The inside of the bordered panel whose top border carries `title`, row by row."""
    for top, row in enumerate(rows):
        at = row.find(title)
        if at < 0:
            continue
        left = row.rfind("╭", 0, at)
        right = row.find("╮", at)
        inside = []
        for line in rows[top + 1:]:
            if line[left:left + 1] == "╰":
                return inside
            inside.append(line[left + 1:right])
        return inside
    raise AssertionError(f"no panel titled {title!r} on the screen")


ENTRY = re.compile(r"(\d+)→(\d+)")


def block_tables(rows: list[str]) -> dict[str, list[int]]:
    """Request -> its physical blocks, as the block tables panel shows them (continuation lines included)."""
    tables: dict[str, list[int]] = {}
    current = None
    for line in panel(rows, "block tables"):
        if "no request holds blocks" in line:
            break
        m = re.match(r"\s*(\S+)", line)   # a request id starts its rows; a row going on starts with an entry
        if m and not ENTRY.match(m[1]):
            current = m[1]
            tables[current] = []
        if current is not None:
            tables[current] += [int(b) for _, b in ENTRY.findall(line)]
    return tables


def free_count(rows: list[str]) -> tuple[int, int]:
    """(free blocks, all blocks) from the free queue panel's "7/20 free"."""
    for line in panel(rows, "free queue"):
        m = re.search(r"(\d+)/(\d+) free", line)
        if m:
            return int(m[1]), int(m[2])
    raise AssertionError("the free queue panel shows no count")
