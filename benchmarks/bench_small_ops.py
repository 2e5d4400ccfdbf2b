"""A Llama layer's small steps on a CPU: torch eager, `torch.compile` (nano-vllm's way), and cpu/ops.c.

    OMP_NUM_THREADS=1 python benchmarks/bench_small_ops.py            # SmolLM2-135M's widths, 1 thread
    python benchmarks/bench_small_ops.py --threads 2 --rows 1,32,512

Between its matmuls a Llama layer runs RMSNorm with the residual add before
it, RoPE on q and k, and silu(gate) * up. nano-vllm fuses each with
`@torch.compile` on one small function (its `RMSNorm.add_rms_forward` and
`SiluAndMul`); nanoserve's CPU fast path calls one C function each
(cpu/ops.c). This script times the three ways on the same inputs, at a
decode step's row counts and a prefill chunk's, checks they agree, and prints
the CPU time of one call (median of many) and the ratios. Inductor's CPU
backend generates C++ for the compiled functions (it needs a C++ compiler);
their compile time is printed apart and not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nanoserve.cpu import ops as cpu_ops
from nanoserve.models.llama import apply_rotary

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64     # SmolLM2-135M
EPS = 1e-5


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h += a, then RMSNorm (nano-vllm's add_rms_forward computes the same)."""
    h.add_(a)
    x = h.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rotary(qk, cos, sin)           # (it broadcasts cos, sin [T, D] over the heads)


def cpu_us(fn, repeat: int) -> float:
    """Median thread CPU time of one call, in microseconds (after a few warm-up calls)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times) / 1e3


def machine() -> str:
    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = line.split()
                flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in have)
                break
    except OSError:
        name = "unknown"
    return f"{name} ({flags}), torch {torch.__version__}, {torch.get_num_threads()} thread(s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32,256", help="row counts (tokens in a step), comma-separated")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    ops = cpu_ops.load()
    if ops is None:
        raise SystemExit("cpu/ops.c could not be built here (no C compiler?)")
    t0 = time.perf_counter()
    compiled = {name: torch.compile(fn) for name, fn in          # default settings, as nano-vllm uses them
                (("add_rms_norm", add_rms_norm), ("silu_mul", silu_mul), ("rotary", rotary))}
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(HIDDEN, generator=gen)
    first = True
    print(f"{'op':<14}{'rows':>6}{'eager us':>11}{'compile us':>12}{'C us':>9}   eager/C  compile/C")
    for rows in (int(r) for r in args.rows.split(",")):
        h = torch.randn(rows, HIDDEN, generator=gen)
        a = torch.randn(rows, HIDDEN, generator=gen)
        gate_up = torch.randn(rows, 2 * INTER, generator=gen)
        qk = torch.randn(rows, HEADS + KV_HEADS, HEAD_DIM, generator=gen)
        angle = torch.randn(rows, HEAD_DIM // 2, generator=gen)
        cos, sin = torch.cat([angle.cos()] * 2, -1).contiguous(), torch.cat([angle.sin()] * 2, -1).contiguous()
        cases = {
            "add_rms_norm": (lambda f: f(h.clone(), a, w), lambda: ops.add_rms_norm(h.clone(), a, w, EPS)),
            "silu_mul": (lambda f: f(gate_up), lambda: ops.silu_mul(gate_up)),
            "rotary": (lambda f: f(qk, cos, sin), lambda: ops.rotary_(qk.clone(), cos, sin)),
        }
        for name, (torch_call, c_call) in cases.items():
            eager_fn = {"add_rms_norm": add_rms_norm, "silu_mul": silu_mul, "rotary": rotary}[name]
            want = torch_call(eager_fn)
            got_compiled = torch_call(compiled[name])          # compiles on the first call of each shape kind
            torch.testing.assert_close(got_compiled, want, atol=1e-5, rtol=1e-5)
            if name != "rotary":                               # (rotary_ works in place; the tests compare it)
                torch.testing.assert_close(c_call(), want, atol=1e-5, rtol=1e-5)
            if first:
                print(f"(torch.compile: first calls, compiling included, took {time.perf_counter() - t0:.1f} s)")
                first = False
            eager = cpu_us(lambda: torch_call(eager_fn), args.repeat)
            comp = cpu_us(lambda: torch_call(compiled[name]), args.repeat)
            c = cpu_us(c_call, args.repeat)
            print(f"{name:<14}{rows:>6}{eager:>11.1f}{comp:>12.1f}{c:>9.1f}   {eager / c:7.2f}x  {comp / c:8.2f}x")


if __name__ == "__main__":
    main()
