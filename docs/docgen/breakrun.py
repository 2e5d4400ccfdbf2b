"""Run a lesson's deliberate mistakes, each as `python lessons/X.py --break NAME` would.

    python docs/docgen/breakrun.py lessons/01_paged_kv_and_batching.py:contiguous,prefill-first ...

Importing torch, transformers and nanoserve costs seconds; a lesson's broken
run often stops at an assert a second later. So this process imports them
once, then forks one child per break: each child runs the lesson as
`__main__` with its own argv, in its own copy of the process, so a break
that patches the engine cannot leak into the next. Prints, as JSON, each
break's exit status and the last line of its error, by lesson.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")     # lesson 3: before triton is first imported
# This file's own folder is sys.path[0]: its modules (kernels.py, cli.py, ...) would shadow packages
# that libraries probe for by name (transformers imports `kernels` if it can). Lessons need none of them.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402,F401  the expensive imports, shared by every child
import transformers  # noqa: E402,F401

import nanoserve  # noqa: E402,F401


def run_one(lesson: str, name: str) -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: the lesson, as a script
        os.close(read)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)                         # its prose is not needed here
        code, last = 0, ""
        try:
            sys.argv = [lesson, "--break", name]
            sys.path.insert(0, os.path.dirname(os.path.abspath(lesson)))
            runpy.run_path(lesson, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:               # noqa: BLE001  whatever stopped it, report it
            code, last = 1, traceback.format_exception_only(type(exc), exc)[-1].strip()
        os.write(write, json.dumps({"rc": code, "last": last}).encode())
        os.close(write)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"rc": -1, "last": "the child died without a word"}


if __name__ == "__main__":
    plan = [arg.rsplit(":", 1) for arg in sys.argv[1:]]           # LESSON:NAME,NAME
    print(json.dumps({lesson: {name: run_one(lesson, name) for name in names.split(",")}
                      for lesson, names in plan}))
