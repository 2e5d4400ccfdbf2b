"""What each Triton kernel asks of a GPU: registers, spills, shared memory, warps, theoretical occupancy.

    python benchmarks/kernel_resources.py                # every kernel x configuration x target, printed
    python benchmarks/kernel_resources.py --write-docs   # and the tables on docs/concepts/kernels.md
    python benchmarks/kernel_resources.py --full         # the full product of the shape axes (slower)

No GPU needed: the kernels are compiled for sm_80, sm_90 and sm_100 with the
ptxas that Triton's wheel ships (nanoserve/kernels/triton_targets.py), at the
shapes and launch choices the engine's wrappers really make
(nanoserve/kernels/triton_shapes.py). Theoretical occupancy is the share of an
SM's 64 warp slots that resident programs can fill, given the registers (64K
an SM, allocated 256 a warp), the shared memory and the block limit; a
memory-bound kernel needs enough loads in flight, and warps are where they
come from. `--write-docs` also compiles the decode and prefill kernels with
their previous launch shape (4 warps, 3 pipeline stages) for the page's
before/after table. tests/test_triton_compile.py checks the page's main table
against its own compile of the same grid.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "concepts" / "kernels.md"
SHORT = {"_paged_decode_kernel": "decode", "_combine_splits_kernel": "split combine",
         "_paged_prefill_kernel": "prefill", "_store_kv_kernel": "store KV", "_copy_blocks_kernel": "copy blocks",
         "fold_kernel": "lab: fold", "step_kernel": "lab: step"}
TARGET_NAMES = ("sm_80", "sm_90", "sm_100")
BEFORE = (4, 3)          # the decode and prefill kernels' launch shape before tuning: (num_warps, num_stages)


def head_dim(r: dict) -> str:
    """The head_dim a kernel was compiled for ("-" where the code does not depend on it)."""
    c = r["constexprs"]
    return str(c["HEAD_DIM"]) if "HEAD_DIM" in c else "-"


def cell(group: list[dict]) -> str:
    """Worst case over a group of compiled configurations: most registers and shared, least occupancy."""
    regs = max(r["registers"] for r in group)
    shared = max(r["shared"] for r in group)
    occ = min(r["occupancy"] for r in group)
    return f"{regs} · {shared / 1024:.1f} KiB · {occ:.0%}"


def summary_table(results: list[dict]) -> str:
    """One row per kernel x dtype x head_dim of the engine's kernels, one column per target."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        if r["where"] == "engine" or r["kernel"] in ("fold_kernel", "step_kernel"):
            groups[(list(SHORT).index(r["kernel"]), r["dtype"], head_dim(r), r["num_warps"], r["target"])].append(r)
    rows = sorted({key[:4] for key in groups}, key=lambda k: (k[0], k[1], int(k[2]) if k[2] != "-" else 0))
    lines = ["| kernel | dtype | head_dim | warps | " + " | ".join(TARGET_NAMES) + " |",
             "|---|---|---:|---:|" + "---:|" * len(TARGET_NAMES)]
    for k in rows:
        cells = [cell(groups[(*k, t)]) if groups.get((*k, t)) else "—" for t in TARGET_NAMES]
        lines.append(f"| {list(SHORT.values())[k[0]]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def before_after_table(before: list[dict], after: list[dict]) -> str:
    """Decode and prefill per dtype x head_dim on sm_80 and sm_90: registers and occupancy, old launch -> new."""
    def by_key(results):
        groups = defaultdict(list)
        for r in results:
            if r["where"] == "engine" and r["kernel"] in ("_paged_decode_kernel", "_paged_prefill_kernel"):
                groups[(r["kernel"] != "_paged_decode_kernel", r["kernel"], r["dtype"], int(head_dim(r)),
                        r["target"])].append(r)
        return groups

    def change(old: list[dict], new: list[dict]) -> str:
        worst = lambda rs: (max(r["registers"] for r in rs), min(r["occupancy"] for r in rs))  # noqa: E731
        (r0, o0), (r1, o1) = worst(old), worst(new)
        return f"{r0} · {o0:.0%} → {r1} · {o1:.0%}"

    old, new = by_key(before), by_key(after)
    lines = ["| kernel | dtype | head_dim | sm_80: registers · occupancy | sm_90 |", "|---|---|---:|---:|---:|"]
    for key in sorted({k[:4] for k in old}):
        cells = [change(old[(*key, t)], new[(*key, t)]) for t in ("sm_80", "sm_90")]
        lines.append(f"| {SHORT[key[1]]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def facts(results: list[dict]) -> dict[str, str]:
    """Inline facts for the page: the compiler versions, how many cubins, the worst occupancies."""
    import triton

    from nanoserve.kernels.triton_targets import ptxas_version

    ok = [r for r in results if "error" not in r]
    spilled = [r for r in ok if r["local_bytes"] or r["stack_bytes"]]
    return {"kernels.triton": f"{triton.__version__}; ptxas {ptxas_version()}",
            "kernels.cubins": str(len(ok)),
            "kernels.spills": "none" if not spilled else f"{len(spilled)} of them"}


def print_all(results: list[dict]) -> None:
    print(f"{'kernel':15s} {'where':6s} {'target':6s} {'dtype':5s} {'constexprs':58s} "
          f"{'warps':>5s} {'regs':>4s} {'spill':>5s} {'shared':>7s} {'occ':>5s}")
    for r in results:
        const = ",".join(f"{k}={v}" for k, v in r["constexprs"].items())
        if "error" in r:
            print(f"{SHORT[r['kernel']]:15s} {r['where']:6s} {r['target']:6s} {r['dtype']:5s} {const:58s} "
                  f"ERROR {r['error']}")
            continue
        print(f"{SHORT[r['kernel']]:15s} {r['where']:6s} {r['target']:6s} {r['dtype']:5s} {const:58s} "
              f"{r['num_warps']:5d} {r['registers']:4d} {r['local_bytes']:5d} {r['shared']:7d} {r['occupancy']:5.0%}")


def write_docs(bodies: dict[str, str]) -> None:
    sys.path.insert(0, str(ROOT / "docs"))
    from docgen import regions

    PAGE.write_text(regions.replace(PAGE.read_text(), bodies, "concepts/kernels.md"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the full product of the shape axes")
    ap.add_argument("--write-docs", action="store_true", help="rewrite the tables on docs/concepts/kernels.md")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it (the interpreter's kernels cannot be compiled)", file=sys.stderr)
        return 2
    from nanoserve.kernels.triton_shapes import compile_all, covering_rows, full_rows

    rows = full_rows() if args.full else covering_rows()
    results = list(compile_all(rows, list(TARGET_NAMES), args.workers, alignments=args.full))
    print_all(results)
    bodies = {"kernels.resources": "\n" + summary_table(results) + "\n", **facts(results)}
    print("\n" + summary_table(results))
    errors = [r for r in results if "error" in r]
    if args.write_docs and not args.full:
        before = list(compile_all(covering_rows(), ["sm_80", "sm_90"], args.workers,
                                  kernels=("_paged_decode_kernel", "_paged_prefill_kernel"), launch=BEFORE))
        bodies["kernels.before-after"] = "\n" + before_after_table(before, results) + "\n"
        print("\n" + bodies["kernels.before-after"])
        write_docs(bodies)
        print(f"\nwrote {PAGE.relative_to(ROOT)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
