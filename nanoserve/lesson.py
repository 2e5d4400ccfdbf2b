"""What every lesson shares: prose that fits the terminal, section titles, and `--break`.

The lessons (lessons/NN_*.py in the repository) import it from the package,
`from nanoserve.lesson import ...`, so a lesson copied anywhere runs where
nanoserve is installed. Nothing in the engine imports it.

A lesson is a script that teaches by checking: it prints what it does, runs
the real engine and `assert`s each claim. Its prose reflows to the width of
your terminal (a paragraph's lines are joined; indented lines and lines
starting with "- " keep their breaks).

Each lesson also lists a few deliberate mistakes:

    python lessons/01_paged_kv_and_batching.py --list-breaks
    python lessons/01_paged_kv_and_batching.py --break slot-formula

With `--break NAME` the lesson makes that one mistake, and must then stop at
an assert whose message says what went wrong: the checks are real, and you
see what each one guards against.
"""

from __future__ import annotations

import argparse
import os
import sys

# Lessons step tiny tensors: one thread is fastest, and a busy machine's other
# programs do not make torch's worker threads wait on each other. Set before
# torch is imported; an explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rich.console import Console  # noqa: E402
from rich.text import Text  # noqa: E402

console = Console(markup=False, highlight=False)   # plain text: "[i // 4]" is not markup


def say(text: str) -> None:
    """Print prose: blank lines end paragraphs, and a paragraph's lines are joined to reflow."""
    paragraphs = text.strip("\n").split("\n\n")
    for i, para in enumerate(paragraphs):
        if i:
            console.print()
        lines = para.splitlines()
        if any(line.startswith((" ", "\t")) for line in lines):
            console.print(para, soft_wrap=True)           # a picture or a table: as written
            continue
        items: list[str] = []
        for line in lines:
            if line.startswith("- ") or not items:
                items.append(line)
            else:
                items[-1] += " " + line
        for item in items:
            console.print(item)


def section(title: str, text: str = "") -> None:
    """A rule with the section's title, then its prose."""
    console.rule(Text(title, style="bold"))
    if text:
        say(text)


def breaks(choices: dict[str, str]) -> str | None:
    """Read `--break NAME` / `--list-breaks` from the command line; the chosen break or None.

    `choices` maps each break's name to what it gets wrong.
    """
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    parser.add_argument("--break", dest="broken", choices=sorted(choices), metavar="NAME",
                        help="make one deliberate mistake (see --list-breaks); an assert must catch it")
    parser.add_argument("--list-breaks", action="store_true", help="list the deliberate mistakes and exit")
    args = parser.parse_args()
    if args.list_breaks:
        for name, what in choices.items():
            print(f"{name:24s} {what}")
        sys.exit(0)
    if args.broken:
        console.print(f"BROKEN ON PURPOSE: {args.broken}: {choices[args.broken]}", style="bold red")
    return args.broken
