"""Known-buggy solutions of the labs, made from the engine's own modules: one small bug per file.

    python tests/lab_bugs/make.py              # check that every bug still applies to the engine's source
    python tests/lab_bugs/make.py DIR          # write every bug as a student file: DIR/<lab>/<bug>.py
    python tests/lab_bugs/make.py DIR --check  # also run `nanoserve lab check --fail-fast` on each and
                                               # say which function its first failing row names

A bug is a `Bug` in tests/lab_bugs/<lab>_bugs.py: the blank that carries it,
one line on what it is, and edits (exact text -> replacement, inside that
function only). The file a student would hand in is the engine's module with
those edits (`bug_source`), so the bugs follow the engine when it changes:
after a rename, run this script; a bug whose function or text is gone fails
here with its name. tests/test_labs.py runs every lab's checks on every bug
and asserts that the first failing row names the function that carries it.

The same files list in EQUIVALENT the mutants of benchmarks/lab_mutation.py
that no check can kill because they do not change what the code does, each
with its reason.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Bug:
    name: str                             # the file's name, e.g. "forward_free"
    function: str                         # the blank that carries the bug, e.g. "BlockPool.free"
    about: str                            # one line: what is wrong
    edits: tuple[tuple[str, str], ...]    # (exact text in that function, its replacement)
    hint: str = ""                        # a phrase the first failing row says (its detail or its hint)


def specs(lab_name: str):
    """(BUGS, EQUIVALENT) of one lab, read from tests/lab_bugs/<lab>_bugs.py."""
    path = HERE / f"{lab_name.replace('-', '_')}_bugs.py"
    spec = importlib.util.spec_from_file_location(f"lab_bugs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return tuple(module.BUGS), dict(getattr(module, "EQUIVALENT", {}))


def bug_source(lab, bug: Bug) -> str:
    """The engine's module for `lab` with `bug`'s edits made inside `bug.function` (ValueError if they do not apply)."""
    from nanoserve.labs.starter import _functions

    source = inspect.getsource(importlib.import_module(lab.module))
    fns = _functions(ast.parse(source))
    if bug.function not in fns:
        raise ValueError(f"{lab.name}/{bug.name}: {lab.module} has no function {bug.function}")
    if bug.function not in lab.blanks:
        raise ValueError(f"{lab.name}/{bug.name}: {bug.function} is not a blank of the lab")
    lines = source.splitlines(keepends=True)
    fn = fns[bug.function]
    start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
    body = "".join(lines[start : fn.end_lineno])
    for old, new in bug.edits:
        if body.count(old) != 1:
            raise ValueError(f"{lab.name}/{bug.name}: {old!r} occurs {body.count(old)} times in {bug.function}, "
                             "not once: the engine changed; update the bug's edit")
        body = body.replace(old, new)
    header = f"# lab bug {lab.name}/{bug.name} (tests/lab_bugs): {bug.about}\n"
    return header + "".join(lines[:start]) + body + "".join(lines[fn.end_lineno :])


def all_bugs():
    """(lab, bug) for every bug of every lab."""
    from nanoserve.labs import get_lab, lab_names
    for name in lab_names():
        lab = get_lab(name)
        for bug in specs(name)[0]:
            yield lab, bug


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv and not argv[0].startswith("-") else None
    problems = 0
    for lab, bug in all_bugs():
        try:
            text = bug_source(lab, bug)
        except ValueError as exc:
            print(f"stale: {exc}")
            problems += 1
            continue
        if out is None:
            continue
        path = out / lab.name / f"{bug.name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if "--check" in argv:
            from nanoserve_labkit.run import run_checks
            rows = run_checks(lab, path, fail_fast=True)
            first = next((r for r in rows if not r.passed), None)
            named = first.function if first else "(every check passed)"
            mark = "ok " if first is not None and first.function == bug.function else "BAD"
            print(f"{mark} {lab.name}/{bug.name}: first failing row names {named or '(the whole component)'}")
            problems += mark == "BAD"
    print(f"{problems} problem(s)" if problems else "every bug applies" + (f"; written to {out}" if out else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
