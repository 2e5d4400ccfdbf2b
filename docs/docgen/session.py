"""Run the Python a page shows and write down what it printed.

Two shapes of transcript:

* a REPL session (```pycon): the `>>>` and `...` lines are the input, run one
  statement at a time like the interactive interpreter does (an expression's
  value is shown with `repr`), and the output lines are rebuilt;
* a script and its output (```python then ```text): the script runs as a
  whole and the text block becomes what it printed.

The input always comes from the page, so what a reader sees is what ran.
Output is rendered at a fixed width (COLUMNS=100) without colours.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

WIDTH = 100
FENCE = re.compile(r"```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)


@contextlib.contextmanager
def terminal(width: int = WIDTH):
    """COLUMNS fixed (rich and shutil read it), output captured; restores both afterwards."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def statements(pycon: str) -> list[str]:
    """The input statements of a REPL transcript: each `>>>` line with its `...` lines."""
    out: list[str] = []
    for line in pycon.splitlines():
        if line.startswith(">>> "):
            out.append(line[4:])
        elif line.startswith("... ") or line == "...":
            out[-1] += "\n" + line[4:]
    return out


def run_session(stmts: list[str], namespace: dict) -> str:
    """Run statements as the interactive interpreter would; the transcript, prompts included."""
    lines = []
    for stmt in stmts:
        src = stmt.splitlines()
        lines.append(">>> " + src[0])
        lines += ["... " + s for s in src[1:]]
        if len(src) > 1:
            lines.append("...")          # a compound statement ends with an empty line
        with terminal() as buf:
            hook, sys.displayhook = sys.displayhook, _display
            try:
                exec(compile(stmt + ("\n" if len(src) > 1 else ""), "<docs>", "single"), namespace)
            finally:
                sys.displayhook = hook
        lines += buf.getvalue().rstrip("\n").splitlines()
    return "\n".join(lines)


def _display(value) -> None:
    if value is not None:
        print(repr(value))


def run_script(source: str, namespace: dict) -> str:
    """Run a script; what it printed."""
    with terminal() as buf:
        exec(compile(source, "<docs>", "exec"), namespace)
    return buf.getvalue().rstrip("\n")


def session_region(body: str, namespace: dict) -> str:
    """A region holding one ```pycon block: the same input, fresh output."""
    m = FENCE.search(body)
    if not m or m["lang"] != "pycon":
        raise ValueError("a session region holds one ```pycon block")
    return f"\n```pycon\n{run_session(statements(m['body']), namespace)}\n```\n"


def script_region(body: str, namespace: dict) -> str:
    """A region holding a ```python block and a ```text block: the same script, fresh output."""
    blocks = FENCE.findall(body)
    if [lang for lang, _ in blocks] not in (["python"], ["python", "text"]):
        raise ValueError("a script region holds a ```python block, then a ```text block")
    source = blocks[0][1]
    return f"\n```python\n{source}\n```\n\n```text\n{run_script(source, namespace)}\n```\n"
