"""`--lab NAME=FILE`: run the real engine (generate, record, the TUI) with a student's component.

    nanoserve tui --lab block-pool=block-pool/block_pool.py
    nanoserve generate --lab radix-cache=radix_cache.py --lab cow-fork=kv_manager.py "Hello"

Each option loads the file, checks that its functions keep the engine's
signatures, and puts the lab's component into one `Components` record
(several labs combine). Every problem is a FieldError naming `--lab`.
"""

from __future__ import annotations

import dataclasses

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
