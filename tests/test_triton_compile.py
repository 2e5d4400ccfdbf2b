"""Every Triton kernel compiled for real GPU targets (sm_80, sm_90, sm_100) on this CPU machine.

The interpreter (tests/test_triton_kernels.py) forgives what a GPU compiler does not:
an unsupported dot shape, a register file too small, shared memory past the target's
limit. Triton's wheel ships ptxas, so `python -m nanoserve.kernels.triton_shapes`
compiles every kernel the engine launches, at the shapes its wrappers are really
called with (head_dim 64/80/128, GQA 1/3/4/8, fp16/bf16/fp32, block sizes 1/16/32,
one split and many), down to a cubin, and reads each one's registers, spills and
shared memory. It runs in a child process: this one has TRITON_INTERPRET=1 (conftest),
under which @triton.jit makes functions that cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nanoserve.kernels.triton_targets import TARGETS, Resources

KERNELS = ["_paged_decode_kernel", "_combine_splits_kernel", "_paged_prefill_kernel", "_store_kv_kernel",
           "_copy_blocks_kernel", "fold_kernel", "step_kernel"]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "nanoserve.kernels.triton_shapes"], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _label(r: dict) -> str:
    return f"{r['kernel']} on {r['target']} ({r['where']}, {r['dtype']}, {r['constexprs']}, {r['num_warps']} warps)"


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_without_spills_within_shared_memory(compiled, kernel, target):
    results = [r for r in compiled if r["kernel"] == kernel and r["target"] == target]
    assert results, f"{kernel} was never launched by the wrappers on the shape grid"
    for r in results:
        assert "error" not in r, f"{_label(r)} does not compile: {r.get('error')}"
        assert r["local_bytes"] == 0 and r["stack_bytes"] == 0, \
            f"{_label(r)} spills: {r['local_bytes']} B local memory, {r['stack_bytes']} B stack a thread"
        assert r["shared"] <= r["shared_limit"], f"{_label(r)} asks {r['shared']} B of shared memory"
        assert r["blocks_per_sm"] >= 1, f"{_label(r)} cannot be resident on an SM"


def test_every_axis_value_is_compiled(compiled):
    """The shape grid reaches every head_dim, GQA ratio, dtype and block size of the issue."""
    decode = [r for r in compiled if r["kernel"] == "_paged_decode_kernel" and r["where"] == "engine"]
    assert {r["row"]["head_dim"] for r in decode} == {64, 80, 128}
    assert {r["constexprs"]["GROUP"] for r in decode} == {1, 3, 4, 8}
    assert {r["dtype"] for r in decode} == {"fp16", "bf16", "fp32"}
    assert {r["constexprs"]["BLOCK_SIZE"] for r in decode} == {1, 16, 32}
    assert {(r["dtype"], r["row"]["head_dim"]) for r in decode} == {(t, d) for t in ("fp16", "bf16", "fp32")
                                                                   for d in (64, 80, 128)}
    combine = {(r["dtype"], r["constexprs"]["HEAD_DIM"]) for r in compiled if r["kernel"] == "_combine_splits_kernel"}
    assert len(combine) == 9


def test_decode_and_prefill_keep_three_eighths_of_the_warp_slots(compiled):
    """The launch shape chosen on the kernels page (8 warps, 2 stages) keeps every configuration at
    >= 37.5 % theoretical occupancy; 4 warps and 3 stages left bf16 at head_dim 128 at 31 % and fp32 at 19 %."""
    for r in compiled:
        if r["kernel"] in ("_paged_decode_kernel", "_paged_prefill_kernel") and r["target"] in ("sm_80", "sm_90"):
            assert r["occupancy"] >= 0.375, f"{_label(r)}: occupancy {r['occupancy']:.0%} ({r['registers']} registers)"


def test_occupancy_arithmetic():
    """The CUDA occupancy calculator's numbers: registers are allocated 256 a warp, 64K an SM."""
    h100 = TARGETS["sm_90"]
    assert Resources(192, 0, 0, 1024, 4).occupancy(h100) == 8 / 64        # the decode kernel: 2 programs
    assert Resources(72, 0, 0, 0, 4).blocks_per_sm(h100) == 7              # 2304 registers a warp
    assert Resources(32, 0, 0, 0, 8).occupancy(h100) == 1.0
    assert Resources(32, 0, 0, 100 * 1024, 4).blocks_per_sm(h100) == 2     # shared memory decides
    assert Resources(16, 0, 0, 0, 1).blocks_per_sm(h100) == 32             # the block limit decides


def test_the_kernels_page_shows_this_compile(compiled):
    """docs/concepts/kernels.md's resource table is what this compile measured (made by
    `python benchmarks/kernel_resources.py --write-docs`); another Triton version compiles other code."""
    from importlib.metadata import version
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    sys.path.insert(0, str(root / "docs"))
    import kernel_resources

    from docgen import regions

    held = regions.regions((root / "docs" / "concepts" / "kernels.md").read_text())
    if not held["kernels.triton"].startswith(version("triton") + ";"):
        pytest.skip(f"the page was made with Triton {held['kernels.triton']}, this is {version('triton')}")
    fresh = {"kernels.resources": "\n" + kernel_resources.summary_table(compiled) + "\n",
             "kernels.cubins": str(sum("error" not in r for r in compiled))}
    for name, body in fresh.items():
        assert not regions.diff(held[name], body, name), \
            "kernels.md is stale: run `python benchmarks/kernel_resources.py --write-docs`\n" \
            + regions.diff(held[name], body, name)
