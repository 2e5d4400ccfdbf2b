"""The Labs pages: `nanoserve lab list`, a check of an untouched starter, rejection sampling's laws, every
lab's checks and "why" questions, and the mutation scores of the checks.

The commands run in a subprocess in a scratch folder at 100 columns, as a
student runs them; the rejection-sampling table calls the engine's own
`spec_decode.verify` thousands of times (seeded) next to the exact target
probabilities and the law of the tempting wrong residual. The checks and the
why questions (answers folded) come from each lab's definition; the scores
from benchmarks/results/lab_mutation.json, which benchmarks/lab_mutation.py
writes (a mutation run takes an hour, so the docs read its result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from docgen import Result
from docgen.cli import terminal_lines

INDEX = "labs/index.md"
REJECTION = "labs/rejection-sampling.md"
SCORES = "benchmarks/results/lab_mutation.json"


def console(cmd: str, cwd: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    argv = [sys.executable, "-m", "nanoserve.cli", *cmd.split()[1:]]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                          timeout=600)
    return f"\n```console\n$ {cmd}\n" + "\n".join(terminal_lines(proc.stdout)) + f"\n$ echo $?\n{proc.returncode}\n```\n"


def law_table() -> str:
    import torch

    from nanoserve.labs.rejection_lab import P, Q, _first_tokens, _scaled_residual_law, _tv
    from nanoserve.spec_decode import verify

    trials = 20000
    got = _first_tokens(verify, torch.stack([P, P]), Q, trials, 2, draft_from_q=True)
    bad = _scaled_residual_law(P, Q)
    rows = [("target p", P), ("draft q", Q), (f"verify, {trials} draws", got),
            ("wrong residual (exact)", bad)]
    lines = ["                          token 0  token 1  token 2  token 3   distance to p"]
    for label, t in rows:
        cells = "".join(f"{float(x):9.3f}" for x in t)
        lines.append(f"{label:24s}{cells}   {_tv(t, P):13.3f}")
    return "\n```text\n" + "\n".join(lines) + "\n```\n"


def checks_list(lab) -> str:
    """The lab's checks, in the order they run (a check that judges one function names it first)."""
    return "\n" + "\n".join(f"{i}. {c.name}" for i, c in enumerate(lab.checks, 1)) + "\n"


def why_section(lab) -> str:
    """The lab's why questions, answers folded (lab check asks them once every check passes)."""
    parts = []
    for i, (question, answer) in enumerate(lab.why, 1):
        parts.append(f'??? question "{i}. {question}"\n' + textwrap.indent(textwrap.fill(answer, 96), "    "))
    return "\n" + "\n\n".join(parts) + "\n"


def score_table(root) -> str:
    """The mutation score of every lab's checks, from the last run of benchmarks/lab_mutation.py."""
    from nanoserve.labs import get_lab, lab_names

    summary = json.loads((root / SCORES).read_text())
    rows = ["| lab | mutants | killed | equivalent | surviving | score |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in lab_names():
        s = summary.get(name)
        if s is None:
            rows.append(f"| {name} | not run | | | | |")
            continue
        lab = get_lab(name)
        rows.append(f"| [{name}]({lab.name}.md) | {s['mutants']} | {s['killed']} | {s['equivalent']} | "
                    f"{len(s['survived'])} | {s['score']:.1f} % |")
    return "\n" + "\n".join(rows) + "\n"


def make(read) -> Result:
    from docgen import ROOT
    from nanoserve.labs import get_lab, lab_names

    out = Result()
    for name in lab_names():
        lab = get_lab(name)
        out.region(f"labs/{name}.md", "labs.checks", checks_list(lab))
        out.region(f"labs/{name}.md", "labs.why", why_section(lab))
    out.region(INDEX, "labs.mutation", score_table(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        out.region(INDEX, "labs.list", console("nanoserve lab list", tmp))
        subprocess.run([sys.executable, "-m", "nanoserve.cli", "lab", "start", "block-pool"], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        out.region(INDEX, "labs.check", console("nanoserve lab check block-pool", tmp))
    out.region(REJECTION, "labs.law", law_table())
    return out
