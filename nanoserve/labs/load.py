"""Importing a student's file, and turning what goes wrong into one line that names file and line.

A student's file is imported under a private, numbered module name (never
as an engine module), so two submissions never see each other and the
engine's own module stays untouched.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import traceback
from pathlib import Path
from types import ModuleType

_counter = itertools.count()


class LoadError(Exception):
    """The student's file could not be imported: the message names the file and line."""


def load_student(path: str | Path) -> ModuleType:
    """Import the file at `path`; LoadError (one line) on a missing file, a syntax error or a raise."""
    path = Path(path)
    if not path.is_file():
        raise LoadError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"nanoserve_lab_student_{next(_counter)}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module    # dataclasses (and pickle) look a class's module up there
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[spec.name]
        raise LoadError(f"{path.name}:{exc.lineno}: syntax error: {exc.msg}") from None
    except BaseException as exc:   # an import that fails, a NameError at the top level, ...
        del sys.modules[spec.name]
        raise LoadError(f"{path.name} does not import: {where(exc, path)}") from None
    return module


def where(exc: BaseException, path: str | Path) -> str:
    """`file:line in func: Type: message`, at the deepest frame inside `path` (else the deepest frame).

    An exception the engine raised *because of* the student's (a StepFailed whose cause is a
    NotImplementedError in their file) is reported as that cause: that is the line to fix.
    """
    target = str(Path(path).resolve())
    chain, seen = exc, set()
    while chain is not None and id(chain) not in seen:   # follow `raise ... from` back to the student's raise
        seen.add(id(chain))
        if any(_resolved(f[0]) == target for f in frames_of(chain)):
            exc = chain
        chain = chain.__cause__ or chain.__context__
    frames = frames_of(exc)
    mine = [f for f in frames if _resolved(f[0]) == target]
    frame = (mine or frames or [None])[-1]
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, NotImplementedError):
        text = f"not written yet ({exc})"
    if frame is None:
        return " ".join(text.split())
    return " ".join(f"{Path(frame[0]).name}:{frame[1]} in {frame[2]}: {text}".split())


def frames_of(exc: BaseException) -> list[tuple]:
    """(file, line, function, source) of every frame `exc` went through, outermost first: here, then
    (an exception that came over the lab's channel carries them as `lab_frames`) in the other process."""
    return [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)] + \
        [tuple(f) for f in getattr(exc, "lab_frames", ())]


def invariant_text(exc: AssertionError) -> str:
    """An assertion's message, or (a bare `assert`) where it stands and its source line."""
    if str(exc).strip():
        return " ".join(str(exc).split())
    frames = frames_of(exc)
    if not frames:
        return "an assertion failed"
    filename, lineno, name, line = frames[-1]
    return f"{Path(filename).name}:{lineno} in {name}: {(line or 'assert').strip()}"


def _resolved(filename: str) -> str:
    try:
        return str(Path(filename).resolve())
    except (OSError, RuntimeError, ValueError):
        return filename
