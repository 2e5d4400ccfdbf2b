"""`--lab NAME=FILE`: run the real engine (generate, record, the TUI) with a student's component.

    nanoserve tui --lab block-pool=block-pool/block_pool.py
    nanoserve generate --lab radix-cache=radix_cache.py --lab cow-fork=kv_manager.py "Hello"
    nanoserve serve --lab capstone/          # a capstone folder: every lab's part at once (labs/capstone.py)

Each option loads the file, checks that its functions keep the engine's
signatures, and puts the lab's component into one `Components` record
(several labs combine). Every problem is a FieldError naming `--lab`. The
TUI asks `broken_invariant` after every step it runs with a student's part,
so a leak or a broken count pauses the run at the step it happens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nanoserve.errors import FieldError


def components_from(specs: list[str] | None):
    """A `Components` with each NAME=FILE's part replaced, or None when `specs` is empty."""
    if not specs:
        return None
    from nanoserve.components import Components
    from nanoserve.labs import get_lab
    from nanoserve.labs.load import LoadError, load_student
    from nanoserve.labs.starter import signature_mismatches

    replaced: dict = {}
    for spec in specs:
        if "=" not in spec and Path(spec).is_dir():    # a capstone folder: every lab's part at once
            from nanoserve.labs.capstone import folder_components
            part = folder_components(spec).replaced()
            clash = set(part) & set(replaced)
            if clash:
                raise FieldError("lab", f"two labs replace the same part ({', '.join(sorted(clash))})")
            replaced.update(part)
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise FieldError("lab", f"takes NAME=FILE, e.g. block-pool=block_pool.py; got {spec!r}")
        lab = get_lab(name)
        try:
            module = load_student(path)
        except LoadError as exc:
            raise FieldError("lab", str(exc)) from None
        bad = signature_mismatches(lab, module)
        if bad:
            raise FieldError("lab", f"{path}: {'; '.join(bad)}")
        try:
            part = lab.components(module).replaced()
        except AttributeError as exc:
            raise FieldError("lab", f"{path}: {exc}") from None
        clash = set(part) & set(replaced)
        if clash:
            raise FieldError("lab", f"two labs replace the same part ({', '.join(sorted(clash))})")
        replaced.update(part)
    return dataclasses.replace(Components(), **replaced)


def explain_failure(exc: BaseException) -> tuple[str, str]:
    """A step that failed in a student's component, as the checks would say it: (where and what, a hint).

    `where` is `file.py:LINE in function: Error: message` at the deepest frame outside nanoserve (the
    student's file); the hint is that of the lab check judging that function (`nanoserve lab check`
    names it too), or a pointer to the checks when no check judges it.
    """
    import traceback
    from pathlib import Path

    import nanoserve
    from nanoserve.labs import get_lab, lab_names
    from nanoserve.labs.load import where

    package = str(Path(nanoserve.__file__).resolve().parent)
    chain, frames, seen = exc, [], set()
    while chain is not None and id(chain) not in seen:       # the student's raise, behind StepFailed
        seen.add(id(chain))
        mine = [f for f in traceback.extract_tb(chain.__traceback__)
                if not str(Path(f.filename).resolve()).startswith(package)]
        if mine:
            exc, frames = chain, mine
        chain = chain.__cause__ or chain.__context__
    if not frames:
        return " ".join(f"{type(exc).__name__}: {exc}".split()), "the engine's own code raised: press q and " \
                                                                   "report it"
    frame = frames[-1]
    text = where(exc, frame.filename)
    for name in lab_names():
        lab = get_lab(name)
        for check in lab.checks:
            if check.function and check.function.rsplit(".", 1)[-1] == frame.name:
                return text, f"{check.hint} (`nanoserve lab check {name} {Path(frame.filename).name}` says more)"
    return text, "run `nanoserve lab check LAB FILE`: its first failing row names the function at fault"


LEAK_HINT = ("a block held by nobody (a leak), or a count that disagrees with the tables: the step's events show "
             "what changed; `nanoserve lab check LAB FILE` names the function at fault")


def broken_invariant(engine) -> tuple[str, str] | None:
    """After a step with a student's part: (the first invariant that no longer holds, a hint), or None.

    The reference implementations' checks on the engine's objects (`drive.reference_invariants`), as the
    lab's checks run them, so a leak shows at the step it happens, not at the end of the run."""
    from nanoserve.labs.drive import reference_invariants
    from nanoserve.labs.load import invariant_text

    try:
        reference_invariants(engine)
    except AssertionError as exc:
        return f"invariant broken: {invariant_text(exc)}", LEAK_HINT
    return None
