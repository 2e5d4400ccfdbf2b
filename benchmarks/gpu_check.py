"""One command for a CUDA machine: every check a CPU could not make, and one summary of them.

    python benchmarks/gpu_check.py             # on a machine with an NVIDIA GPU (about 5 minutes on an H100)
    python benchmarks/gpu_check.py --dry-run   # anywhere: the checks, their time budgets, what to install

What it needs: torch with CUDA (Triton comes with it on Linux) and nanoserve's
dev extra for pytest and transformers, from the repository root:

    pip install -e ".[dev]"

On a machine without CUDA it prints one line and exits 2.

Each check runs in its own process under its time budget, so a hung or crashed
check is one line of the summary, not the end of the run; the budgets add up
to under 8 minutes. The tests run with NANOSERVE_TEST_DEVICE=cuda: their
engines, models and tensors on the GPU, Triton compiled for it (no interpreter).

    kernels      tests/test_triton_kernels.py on cuda: every kernel against the torch reference
    shapes       every kernel against the reference at the engine's real shapes (head_dim 64/80/128,
                 GQA 1/3/4/8, fp16/bf16/fp32, block sizes 1/16/32: the compile tests' grid)
    parity       tests/test_parity.py on cuda: greedy tokens equal HF generate's (tiny GPT-2 and
                 Llama, fp32) under chunked prefill, preemption and prefix-cache hits
    graphs       tests/test_cuda_graphs.py on cuda: graphs captured and replayed, the same tokens and
                 KV as eager
    bandwidth    bench_kernels.py --only decode prefill: the decode kernel's bandwidth against a
                 device-to-device copy and SDPA on contiguous K/V; prefill over a cached prefix
    end-to-end   bench_kernels.py --only e2e: tokens/s against HF generate, graphs on and off
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
BENCH = [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py")]


@dataclass(frozen=True)
class Check:
    name: str
    about: str
    command: list[str]
    budget_s: int          # killed past this: the summary says "timed out"


CHECKS = [
    Check("kernels", "the Triton kernel tests on cuda",
          [*PYTEST, "tests/test_triton_kernels.py"], 90),
    Check("shapes", "every kernel against torch at the real shapes",
          [sys.executable, __file__, "--shapes"], 90),
    Check("parity", "greedy parity with HF: chunks, preemption, prefix hits",
          [*PYTEST, "tests/test_parity.py"], 90),
    Check("graphs", "CUDA graphs on and off: the same tokens and KV",
          [*PYTEST, "tests/test_cuda_graphs.py"], 45),
    Check("bandwidth", "decode against a D2D copy and SDPA; prefill",
          [*BENCH, "--only", "decode", "prefill", "--repeats", "10"], 75),
    Check("end-to-end", "tokens/s against HF generate, graphs on and off",
          [*BENCH, "--only", "e2e"], 75),
]


def summarize(check: Check, output: str) -> str:
    """The line of a check's output that says the most: pytest's tally, or the benchmark's key rows."""
    lines = [" ".join(line.split()) for line in output.splitlines() if line.strip()]
    if check.command[:3] == PYTEST[:3]:
        return next((line for line in reversed(lines) if " passed" in line or " failed" in line or " error" in line),
                    lines[-1] if lines else "")
    if check.name == "bandwidth":     # the largest decode row, and the longest prefix's prefill row
        decode = [line for line in lines if line.split()[0].isdigit() and "us" in line and line.count("%") >= 1]
        prefill = [line for line in lines if line.split()[0].isdigit() and "us" in line and "%" not in line]
        return f"decode {decode[-1] if decode else '?'} | prefill {prefill[-1] if prefill else '?'}"
    if check.name == "end-to-end":
        return " | ".join(line for line in lines if line.startswith(("graphs /", "greedy tokens")))
    return lines[-1] if lines else ""


def run_check(check: Check) -> tuple[str, float, str]:
    """(result, seconds, detail): the check in a child process with NANOSERVE_TEST_DEVICE=cuda."""
    env = {**os.environ, "NANOSERVE_TEST_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(check.command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=check.budget_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "TIMED OUT", time.perf_counter() - t0, summarize(check, out)
    seconds = time.perf_counter() - t0
    print(f"\n===== {check.name}: {check.about}\n{proc.stdout}{proc.stderr[-4000:]}", flush=True)
    return ("pass" if proc.returncode == 0 else f"FAIL ({proc.returncode})"), seconds, summarize(check, proc.stdout)


def shapes(device: str = "cuda", rows=None, lens: tuple[int, ...] = (4000, 1000, 77, 1)) -> int:
    """Every Triton kernel against the torch reference on cuda, at each covering row of the compile grid.

    Decode: a batch of `lens` (16 splits, 4, 1, one token); prefill: 37 queries at the end of the second
    sequence and 5 at the end of the third, both over their cached prefix; store and copy exactly."""
    import torch

    from nanoserve.kernels import reference, triton_cache, triton_decode, triton_prefill
    from nanoserve.kernels.triton_shapes import covering_rows

    rows = rows or covering_rows()
    for row in rows:
        dt, bs, hkv, d = getattr(torch, row.dtype), row.block_size, row.kv_heads, row.head_dim
        hq, tol = hkv * row.group, (1e-4 if row.dtype == "float32" else 2e-2)
        g = torch.Generator(device=device).manual_seed(0)
        nb = [-(-n // bs) for n in lens]
        k_cache, v_cache = (torch.randn(sum(nb) + 4, bs, hkv, d, generator=g, device=device).to(dt) for _ in "kv")
        perm = torch.randperm(sum(nb) + 4, generator=g, device=device)
        tables = torch.zeros(len(lens), max(nb), dtype=torch.int64, device=device)
        for i, (start, n) in enumerate(zip([0, *torch.tensor(nb).cumsum(0).tolist()], nb)):
            tables[i, :n] = perm[start : start + n]
        seq_lens = torch.tensor(lens, device=device)
        q = torch.randn(len(lens), hq, d, generator=g, device=device).to(dt)
        errors = {"decode": (triton_decode.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
                             - reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5))}
        chunks = [(1, 37), (2, 5)]                      # (sequence, queries at its end)
        qp = torch.randn(42, hq, d, generator=g, device=device).to(dt)
        got = triton_prefill.prefill_attention(qp, k_cache, v_cache, tables[1:3], torch.tensor([0, 37], device=device),
                                               torch.tensor([37, 5], device=device), seq_lens[1:3], d**-0.5)
        want = torch.cat([reference.prefill_attention(qp[s : s + n], k_cache, v_cache, tables[i], lens[i], d**-0.5)
                          for (i, n), s in zip(chunks, (0, 37))])
        errors["prefill"] = got - want
        k_new, v_new = (torch.randn(42, hkv, d, generator=g, device=device).to(dt) for _ in "kv")
        slots = torch.randperm(k_cache.shape[0] * bs, generator=g, device=device)[:42]
        kc, vc, kr, vr = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        triton_cache.store_kv(k_new, v_new, kc, vc, slots)
        reference.store_kv(k_new, v_new, kr, vr, slots)
        errors["store"] = torch.cat([(kc - kr).flatten(), (vc - vr).flatten()]).float()
        triton_cache.copy_blocks([kc, vc], torch.tensor([0, 1], device=device), torch.tensor([2, 3], device=device))
        errors["copy"] = torch.cat([(kc[2:4] - kc[0:2]).flatten(), (vc[2:4] - vc[0:2]).flatten()]).float()
        for name, err in errors.items():
            e = err.abs().max().item()
            if not e <= (0 if name in ("store", "copy") else tol):
                print(f"{name} at {row}: max difference {e:.2e} from the reference (tolerance {tol})")
                return 1
        print(f"{row}: decode, prefill, store, copy match the reference", flush=True)
    print(f"{len(rows)} shapes x 4 kernels match the torch reference on {device}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and their time budgets; run nothing")
    ap.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run only these checks")
    ap.add_argument("--shapes", action="store_true", help=argparse.SUPPRESS)     # the `shapes` check's own process
    args = ap.parse_args(argv)
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    if args.dry_run:
        print("gpu_check would run, each in its own process, killed past its budget:")
        for c in checks:
            print(f"  {c.name:11s} {c.budget_s:4d} s  {c.about}")
            shown = ["python" if a == sys.executable else os.path.relpath(a, ROOT) if a.startswith("/") else a
                     for a in c.command]
            print(f"  {'':11s}         $ {' '.join(shown)}")
        print(f"  {'total':11s} {sum(c.budget_s for c in checks):4d} s  at most")
        print('needs: torch with CUDA (and its Triton), pip install -e ".[dev]" (pytest, transformers)')
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with an "
              "NVIDIA GPU, or --dry-run to list the checks")
        return 2
    if args.shapes:
        return shapes()
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    results = [(c, *run_check(c)) for c in checks]
    print("\n===== summary")
    for c, result, seconds, detail in results:
        print(f"{c.name:11s} {result:10s} {seconds:5.0f} s / {c.budget_s:3d} s  {detail}")
    return 0 if all(result == "pass" for _, result, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
