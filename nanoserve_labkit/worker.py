"""The process that holds a student's code: `python -m nanoserve_labkit.worker READ_FD WRITE_FD CPU_S MODULE...`.

It is started by `sandbox.py` (in its own session, in a scratch folder, with
resource limits), imports the engine modules the lab needs (the one the
student rewrites with those bodies withheld: `blanks.py`), then answers the
checker's requests on the channel (`remote.py`) until the channel closes
(the student's file is imported under `guard.py`'s audit hook):

    load PATH      import the student's file; a handle to the module (or LoadError, one line)
    helper F ARGS  run a lab's helper here, next to the student's code (the Triton lab builds
                   its kernels around the student's function here, never in the checker)
    reset          forget the objects of the last check

and every request on the objects it handed out. It decides nothing: the
checker holds the checks and the verdict. Its stdin, stdout and stderr are
/dev/null (a student's prints, however many, go nowhere and cannot reach the channel).
"""

from __future__ import annotations

import importlib
import os
import resource
import signal
import sys

MEMORY_BYTES = 4 << 30      # address space: torch and Triton's interpreter fit well inside; a huge allocation fails
FILE_BYTES = 64 << 20       # the largest file the student's code may write (in its scratch folder, or anywhere)
OPEN_FILES = 256


def limit(cpu_s: int) -> None:
    """Resource limits for this process and everything it starts (hard limits: the code cannot raise them)."""
    for what, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_FSIZE, FILE_BYTES),
                        (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0),
                        (resource.RLIMIT_CPU, cpu_s)):
        soft, hard = resource.getrlimit(what)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a write past the limit fails (EFBIG); it does not kill


def main(argv: list[str]) -> int:
    read_fd, write_fd, cpu_s = int(argv[0]), int(argv[1]), int(argv[2])
    limit(cpu_s)
    # Triton on a CPU runs under its interpreter, which must be on before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch  # noqa: F401 -- loaded before guard.py's audit hook, which refuses the C library loads it makes

    from nanoserve_labkit import blanks
    # first: the lab's module (the capstone: every part's), blanked before anything imports it
    withheld = blanks.install([s for s in map(blanks.parse_spec_arg, argv[3:]) if s is not None])
    for name in ["nanoserve.labs.starter", *argv[3:]]:   # the engine's modules: imported before the student's
        if blanks.parse_spec_arg(name) is None:
            importlib.import_module(name)
    from nanoserve_labkit import wire
    from nanoserve_labkit.remote import Endpoint

    ep = Endpoint(send=lambda m: wire.send(write_fd, m), recv=lambda deadline: wire.recv(read_fd, deadline))
    install(ep, withheld)
    wire.send(write_fd, {"ready": os.getpid()})
    while True:
        try:
            message = wire.recv(read_fd)
        except wire.ChannelBroken:
            return 0
        wire.send(write_fd, ep.serve(message))


def install(ep, withheld=()) -> None:
    """The worker's own requests (load, helper, reset) on endpoint `ep`; with `withheld` (blanks.py's
    Withheld, one per module), the student's file is imported under the audit hook of `guard.py`, which
    allows the bodies of every file the load names (`also`: the capstone's other parts) and no others."""
    pinned: dict[int, object] = {}

    def load(ep, m):
        from nanoserve.labs.load import load_student
        from nanoserve_labkit.blanks import own_code
        if withheld:
            from nanoserve_labkit.guard import lock
            lock(withheld, [str(m.get("path")), *map(str, m.get("also") or [])])
        module = load_student(str(m.get("path")))
        if m.get("blanks"):
            own_code(module, m["blanks"], str(m.get("path")))
        pinned[ep.export(module)] = module
        return module

    def helper(ep, m):
        module_name, _, name = str(m.get("f")).partition(":")
        if not module_name.startswith("nanoserve.labs."):
            raise ValueError(f"no helper {m.get('f')!r}")
        fn = getattr(importlib.import_module(module_name), name)
        return fn(*[ep.decode(a) for a in m.get("a") or []], **{k: ep.decode(v) for k, v in (m.get("k") or {}).items()})

    def reset(ep, m):
        ep.exports = dict(pinned)
        ep.handles = {id(obj): h for h, obj in pinned.items()}
        ep.proxies.clear()
        return None

    ep.serve_ops.update(load=load, helper=helper, reset=reset)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
