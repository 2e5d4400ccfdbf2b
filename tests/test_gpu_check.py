"""benchmarks/gpu_check.py on a CPU: one line and exit 2 without CUDA; --dry-run lists every check and its budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu_check would run its checks")
def test_without_cuda_one_line_and_exit_2():
    proc = run()
    assert proc.returncode == 2
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU here"), proc.stdout + proc.stderr
    assert "--dry-run" in lines[0]


def test_dry_run_lists_every_check_with_its_budget():
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    budgets = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 2 and words[2] == "s" and words[1].isdigit():
            budgets[words[0]] = int(words[1])
    assert set(budgets) == {"kernels", "shapes", "parity", "graphs", "bandwidth", "end-to-end", "total"}
    assert budgets["total"] == sum(v for k, v in budgets.items() if k != "total") < 8 * 60
    assert "pip install" in out and "tests/test_cuda_graphs.py" in out and "benchmarks/gpu_check.py --shapes" in out


def test_the_shapes_check_runs_under_the_interpreter():
    """The `shapes` check's own code, on two small rows on the CPU (its real run is on cuda, at full size)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    from nanoserve.kernels.triton_shapes import Row

    assert gpu_check.shapes("cpu", [Row("float32", 64, 3, 16, 2), Row("float16", 80, 1, 1, 2)],
                            lens=(300, 60, 9, 1)) == 0
