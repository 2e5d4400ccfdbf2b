"""concepts/kernels.md: what `benchmarks/gpu_check.py --dry-run` lists (the checks a GPU run makes, their budgets).

The page's resource tables are not made here: compiling every kernel takes minutes, so
`python benchmarks/kernel_resources.py --write-docs` writes them and tests/test_triton_compile.py
checks them against its own compile.
"""

from __future__ import annotations

import subprocess
import sys

from docgen import ROOT, Result


def make(read) -> Result:
    out = Result()
    command = ["benchmarks/gpu_check.py", "--dry-run"]
    text = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    out.region("concepts/kernels.md", "kernels.gpu-check",
               f"\n```console\n$ python {' '.join(command)}\n{text}```\n")
    return out
