"""Counts and sizes the pages state about the code: how many lessons, how long the modules are.

Prose that says "fifteen lessons" or "modules of 60–300 lines" goes stale the
day a lesson is added or a module grows; these facts are read from the
repository instead, and tests/test_docs.py notices when a page no longer says
what they are.
"""

from __future__ import annotations

from statistics import median

from docgen import ROOT

NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen nineteen twenty").split()


def number(n: int) -> str:
    """A count in words up to twenty (as prose writes it), digits above."""
    return NUMBERS[n] if 0 <= n < len(NUMBERS) else str(n)


def lessons() -> list[str]:
    """The lesson scripts, in order (lessons/NN_*.py)."""
    return sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def module_lines(package: str = "nanoserve") -> dict[str, int]:
    """Module path under the package -> its number of lines (every .py file, package __init__s included)."""
    root = ROOT / package
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def module_facts() -> dict[str, str]:
    """How many modules the engine has, the median size, and the longest one."""
    lines = {name: n for name, n in module_lines().items() if not name.endswith("__init__.py")}
    longest = max(lines, key=lines.get)
    return {"num_modules": str(len(lines)), "median_lines": str(round(median(lines.values()))),
            "longest": f"`{longest}`, {lines[longest]} lines"}
