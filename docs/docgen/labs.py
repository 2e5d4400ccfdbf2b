"""The Labs pages: `nanoserve lab list`, a check of an untouched starter, and rejection sampling's laws.

The commands run in a subprocess in a scratch folder at 100 columns, as a
student runs them; the rejection-sampling table calls the engine's own
`spec_decode.verify` thousands of times (seeded) next to the exact target
probabilities and the law of the tempting wrong residual.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from docgen import Result
from docgen.cli import terminal_lines

INDEX = "labs/index.md"
REJECTION = "labs/rejection-sampling.md"


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


def make(read) -> Result:
    out = Result()
    with tempfile.TemporaryDirectory() as tmp:
        out.region(INDEX, "labs.list", console("nanoserve lab list", tmp))
        subprocess.run([sys.executable, "-m", "nanoserve.cli", "lab", "start", "block-pool"], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        out.region(INDEX, "labs.check", console("nanoserve lab check block-pool", tmp))
    out.region(REJECTION, "labs.law", law_table())
    return out
