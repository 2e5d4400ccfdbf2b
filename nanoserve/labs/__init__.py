"""`nanoserve lab`: write one component of the engine, and the real engine judges it.

Each lab (`lab.py`) names an engine module, the bodies a student writes, and
checks that run the real engine with the student's component plugged in
through `Components` (components.py). This package holds what a student
reads: each lab's text, its starter's rules and its checks. The machinery
that isolates and judges a submission (the worker, its channel, the sandbox,
the mutation tool, the `nanoserve lab` command) is its own package,
`nanoserve_labkit`, shipped in the same wheel. Modules:

    lab.py        Lab, Check, CheckFailed, Context: what a lab is
    starter.py    starters made from the engine's own modules (guided and design mode); signature checks
    load.py       importing a student's file; errors as one line with file and line
    drive.py      the real engine with a student's component, against the engine's own
    plug.py       `--lab NAME=FILE` on generate, record and tui; a failed step explained for the TUI
    common.py     the check every lab shares (signatures)
    *_lab.py      one module per lab: block_pool, radix_cache, cow_fork, scheduler (budget),
                  preemption, rejection (sampling), paged_attention, triton (decode), commit (the step's)
    capstone.py   every lab's part at once as one engine (`--lab DIR`, `nanoserve lab capstone`)
    capstone_fuzz.py   the capstone's state machine: a seeded plan of random operations, applied to an engine
    commit_setup.py    the step-commit lab's bench: stand-ins, a table around the student's class, the engine run
    triton_kernels.py  the triton-decode lab's kernels around a student's step (built in the worker)
    triton_fold.py     its probe kernels: one step, and a fold over a few tiles (a file: GPU targets compile it)
"""

from __future__ import annotations

import importlib

from nanoserve.errors import FieldError

# lab name -> the module defining its LAB (imported on first use: listing labs loads no torch)
LAB_MODULES = {
    "block-pool": "nanoserve.labs.block_pool_lab",
    "radix-cache": "nanoserve.labs.radix_cache_lab",
    "rejection-sampling": "nanoserve.labs.rejection_lab",
    "cow-fork": "nanoserve.labs.cow_fork_lab",
    "scheduler-budget": "nanoserve.labs.scheduler_lab",
    "preemption": "nanoserve.labs.preemption_lab",
    "paged-attention": "nanoserve.labs.paged_attention_lab",
    "triton-decode": "nanoserve.labs.triton_lab",
    "step-commit": "nanoserve.labs.commit_lab",
}


def lab_names() -> list[str]:
    return list(LAB_MODULES)


def get_lab(name: str):
    """The Lab called `name`; FieldError naming the known labs otherwise."""
    if name not in LAB_MODULES:
        raise FieldError("lab", f"{name!r} is not a lab; the labs are: {', '.join(LAB_MODULES)}")
    return importlib.import_module(LAB_MODULES[name]).LAB
