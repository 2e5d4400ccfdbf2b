"""concepts/kernels.md: the C files' facts, and what `benchmarks/gpu_check.py --dry-run` lists.

Which functions each C file of the CPU fast path exports (never its length:
a size teaches nothing and changes with every edit), and what cpu_math.h says of its exp (lanes per
vector, error in ulp) are stated on the page from the sources, so they
cannot drift when the C changes. The GPU check's list (the checks a GPU run
makes, their budgets) is its own `--dry-run` output.

The page's Triton resource tables are not made here: compiling every kernel takes minutes, so
`python benchmarks/kernel_resources.py --write-docs` writes them and tests/test_triton_compile.py
checks them against its own compile.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nanoserve
from docgen import ROOT, Result

PAGE = "concepts/kernels.md"
CPU = Path(nanoserve.__file__).parent / "cpu"


def c_file_facts(path: Path) -> dict:
    """The exported functions: how many, and their names (never the file's size: tests/test_docs.py)."""
    text = path.read_text()
    # a top-level definition that is not `static`: `int name(` or `void name(` at the start of a line
    exported = re.findall(r"^(?!static)(?:int|void|float)\s+(\w+)\s*\(", text, flags=re.MULTILINE)
    return {"functions": len(exported), "names": ", ".join(f"`{n}`" for n in exported)}


def exp_facts() -> dict:
    header = (CPU / "cpu_math.h").read_text()
    ulp = re.search(r"Within ([\d.]+) ulp", header)
    width = re.search(r"typedef float f8 __attribute__\(\(vector_size\((\d+)\)\)\)", header)
    wide = re.search(r"#if defined\(__AVX512F__\)\n#define VEC_LANES (\d+)", header)
    assert ulp and width and wide, "cpu_math.h no longer states its exp's error or its vector widths"
    return {"exp_ulp": ulp.group(1), "lanes": int(width.group(1)) // 4, "wide_lanes": int(wide.group(1))}


def make(read) -> Result:
    out = Result()
    stated = {"attention": ("functions", "names"), "ops": ("functions", "names"), "matmul": ("names",)}
    for name, keys in stated.items():
        facts = c_file_facts(CPU / f"{name}.c")
        out.facts(PAGE, f"kernels.{name}", {k: facts[k] for k in keys})
    out.facts(PAGE, "kernels", exp_facts())
    command = ["benchmarks/gpu_check.py", "--dry-run"]
    text = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    out.region(PAGE, "kernels.gpu-check", f"\n```console\n$ python {' '.join(command)}\n{text}```\n")
    return out

# (Not named kernels.py: breakrun.py runs with docs/docgen/ on sys.path, and transformers imports any top-level
# module named `kernels` it can find, taking it for Hugging Face's kernels package.)
