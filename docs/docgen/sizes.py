"""Counts the pages state about the course: how many lessons and scenarios.

Prose that says "fifteen lessons" goes stale the day a lesson is added; the
count is read from the repository instead, and tests/test_docs.py notices
when a page no longer says it. Sizes of the code (lines, modules) are not
stated at all: they change with every edit and teach nothing
(tests/test_docs.py refuses them in prose pages).
"""

from __future__ import annotations

from docgen import ROOT

NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen nineteen twenty").split()


def number(n: int) -> str:
    """A count in words up to twenty (as prose writes it), digits above."""
    return NUMBERS[n] if 0 <= n < len(NUMBERS) else str(n)


def lessons() -> list[str]:
    """The lesson scripts, in order (lessons/NN_*.py)."""
    return sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
