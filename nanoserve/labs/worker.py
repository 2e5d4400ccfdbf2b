"""The process that runs a lab's checks: `python -m nanoserve.labs.worker LAB FILE FIRST_CHECK`.

It writes one JSON line when a check starts and one with its result; the
student's own prints go to stderr so they cannot garble that stream.
`run.py` reads it and enforces the time limits.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    lab_name, path, first = argv[0], argv[1], int(argv[2])
    # Triton on a CPU runs under its interpreter, which must be on before triton is first imported
    # (torch and transformers import it). No lab needs compiled Triton, so the worker always sets it.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    out = os.fdopen(os.dup(1), "w", buffering=1)   # our channel; fd 1 now goes to stderr for the student
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from nanoserve.labs import get_lab
    from nanoserve.labs.lab import Context
    from nanoserve.labs.load import LoadError, load_student
    from nanoserve.labs.run import run_one

    lab = get_lab(lab_name)
    try:
        module = load_student(path)
    except LoadError as exc:
        out.write(json.dumps({"load_error": str(exc)}) + "\n")
        return 0
    ctx = Context(lab, module, path)
    for i in range(first, len(lab.checks)):
        out.write(json.dumps({"started": i}) + "\n")
        out.write(run_one(ctx, i).to_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
