"""Generated regions of a docs page, and how two copies of one are compared.

A page marks what a program writes for it:

    <!--gen:NAME-->whatever the generator wrote last time<!--/gen-->

A region can hold a whole fenced block (a transcript) or a few words inside
a sentence (a fact: a block number, a step). A block region inside an
admonition or a list item is indented like the line its marker is on. Everything outside the markers
is prose that people write. `replace` puts fresh text in; `regions` reads
what a page holds, so a test can compare it with a fresh run.

Two copies are compared after `normalize`, which hides what a rerun may
change without the engine changing: wall-clock times ("12.3 ms",
"duration_s=0.0123", "3.4k tokens/s"), a log-probability's digits past the
second decimal, and the padding a rich panel adds around a number whose width
changed.
"""

from __future__ import annotations

import difflib
import re

REGION = re.compile(r"<!--gen:(?P<name>[\w.-]+)-->(?P<body>.*?)<!--/gen-->", re.S)

# Wall-clock measurements, whatever their width: masked before comparing.
TIMINGS = [
    (re.compile(r"duration_s=[0-9.e+-]+"), "duration_s=<t>"),
    (re.compile(r"\b\d+(\.\d+)?k? (tokens|tok|it)/s"), "<t> /s"),
    (re.compile(r"\[\d\d:\d\d<[\d:?]+, +[\d.?]+ ?it/s\]"), "[<t>]"),      # a progress bar's clock
    (re.compile(r"\b\d+(\.\d+)? ?(ms|s)\b"), "<t> s"),
    # A log-probability's last digits differ from one CPU to the next (float32 sums in another order)
    (re.compile(r"(logprob=-?\d+\.\d{2})\d*"), r"\1…"),
]


def regions(text: str) -> dict[str, str]:
    """Region name -> body, for every region of a page.

    A fact may be stated twice on a page (the same name twice); both copies must agree.
    """
    found: dict[str, str] = {}
    for m in REGION.finditer(text):
        if m["name"] in found and found[m["name"]] != m["body"]:
            raise ValueError(f"region {m['name']!r} appears twice with different text")
        found[m["name"]] = m["body"]
    return found


def replace(text: str, bodies: dict[str, str], page: str = "page") -> str:
    """The page with each named region's body replaced; every name must have a region."""
    missing = set(bodies) - set(regions(text))
    if missing:
        raise KeyError(f"{page} has no region named {', '.join(sorted(missing))} "
                       f"(add <!--gen:NAME--><!--/gen--> where it goes)")
    def fill(m: re.Match) -> str:
        body = bodies.get(m["name"], m["body"])
        if m["name"] in bodies:   # inside an admonition or a list: indent like the marker's line
            line = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
            indent = line if not line.strip() else ""
            body = "\n".join((indent + x if x.strip() and i else x) for i, x in enumerate(body.split("\n")))
            body = body + indent if body.endswith("\n") else body
        return f"<!--gen:{m['name']}-->{body}<!--/gen-->"

    return REGION.sub(fill, text)


def block(body: str, lang: str = "text") -> str:
    """A fenced code block as a region body (on its own lines)."""
    return f"\n```{lang}\n{body.rstrip()}\n```\n"


def normalize(text: str) -> str:
    """What must match between a page and a fresh run: times masked, runs of blanks and of
    rules (a panel title's border shrinks when the time in it grows) collapsed."""
    for pattern, mask in TIMINGS:
        text = pattern.sub(mask, text)
    lines = (re.sub(r"─{2,}", "─", re.sub(r"[ \t]+", " ", line)).strip() for line in text.strip().splitlines())
    return "\n".join(lines)


def diff(old: str, new: str, name: str) -> str:
    """A short unified diff of two normalized copies ('' when they match)."""
    a, b = normalize(old), normalize(new)
    if a == b:
        return ""
    lines = difflib.unified_diff(a.splitlines(), b.splitlines(), f"{name} (page)", f"{name} (fresh run)",
                                 lineterm="", n=1)
    return "\n".join(list(lines)[:40])
