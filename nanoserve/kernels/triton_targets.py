"""Compile the Triton kernels for real GPU targets on a machine with no GPU, and read what they use.

Triton's wheel ships NVIDIA's `ptxas` and `cuobjdump`, so a kernel compiles
all the way to a cubin (machine code for one GPU generation) without a GPU.
This module owns three things:

    capture_launches()     run the real wrappers (decode_attention, store_kv, ...) on small CPU
                           tensors; every kernel launch they make is recorded instead of run, with
                           the exact signature, constexprs, alignment facts and num_warps Triton's
                           launcher derives from those arguments (so the wrappers' own tile and
                           warp choices are what get compiled, not a copy of them)
    compile_for(launch, target)     triton.compile(...) for sm_80 / sm_90 / sm_100
    Resources                       registers, spills, shared memory, theoretical occupancy

The shapes to try live in triton_shapes.py; the tests, benchmarks/kernel_resources.py and
the kernels page use both. This process must not run Triton's interpreter
(TRITON_INTERPRET=1 turns every @triton.jit into a Python function that cannot be
compiled): `python -m nanoserve.kernels.triton_shapes` starts a clean one.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Target:
    """One GPU generation: the limits that decide how many programs fit on one SM."""
    name: str                  # "sm_90"
    capability: int            # 90
    gpu: str                   # a GPU of that generation, for the reader
    shared_per_block: int      # most dynamic shared memory one program may ask for (bytes)
    shared_per_sm: int         # shared memory of one SM (bytes); each resident program also costs 1 KiB
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32


# Limits from NVIDIA's CUDA C++ Programming Guide, "Compute capabilities" table.
TARGETS = {
    "sm_80": Target("sm_80", 80, "A100", 166912, 167936),
    "sm_90": Target("sm_90", 90, "H100", 232448, 233472),
    "sm_100": Target("sm_100", 100, "B200", 232448, 233472),
}


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch as Triton's launcher specialised it: enough to compile it for any target."""
    kernel: object             # the JITFunction
    signature: dict            # argument name -> "*bf16", "i32", "constexpr", ...
    constants: dict            # (argument index,) -> constexpr value
    attrs: dict                # (argument index,) -> [["tt.divisibility", 16]] where an argument is aligned
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexprs(self) -> dict[str, object]:
        """The kernel's declared constexpr values by name, e.g. {"BLOCK_N": 32, ...}.

        (`constants` also holds integer arguments Triton specialised because they were 1.)"""
        params = self.kernel.params
        return {params[i].name: v for (i, *_), v in self.constants.items() if params[i].is_constexpr}

    def shape_key(self) -> tuple:
        """What the kernel's code depends on apart from alignment and value specialisation."""
        pointers = tuple(t for t in self.signature.values() if t.startswith("*"))
        return (id(self.kernel), pointers, tuple(sorted(self.constexprs().items())), self.num_warps,
                self.num_stages)


class _CompileOnlyDriver:
    """What Triton's launcher asks a driver before it compiles: a device, a stream and a target."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self):
        return "compile-only"           # its own entry in each kernel's per-device caches

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def capture_launches():
    """Inside this block a Triton launch is recorded in the yielded list and skipped (nothing runs).

    Triton's `jit_cache_hook` is called just before a launch would compile; returning True
    tells the launcher to stop there, so the wrapper goes on as if the kernel had run.
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    launches: list[Launch] = []

    def record(*, fn, compile, **_):
        launches.append(Launch(fn.jit_function, dict(compile["signature"]), dict(compile["constants"]),
                               dict(compile["configs"][0]), compile["num_warps"], compile["num_stages"]))
        return True

    previous_hook, previous_driver = knobs.runtime.jit_cache_hook, driver._active
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", 90, 32)))
    knobs.runtime.jit_cache_hook = record
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


@dataclass(frozen=True, slots=True)
class Resources:
    """What one compiled kernel asks of an SM, and how many of its programs fit at once."""
    registers: int             # per thread
    local_bytes: int           # local memory per thread: register spills (0 is the only good value)
    stack_bytes: int
    shared: int                # dynamic shared memory per program (bytes)
    warps: int

    def blocks_per_sm(self, target: Target) -> int:
        """Programs resident on one SM: the tightest of the register, shared-memory, warp and block limits."""
        regs_per_warp = -(-self.registers * 32 // 256) * 256        # registers are allocated 256 per warp
        by_regs = target.registers_per_sm // (regs_per_warp * self.warps)
        by_shared = target.shared_per_sm // (self.shared + 1024)    # the driver reserves 1 KiB per program
        by_warps = target.max_warps_per_sm // self.warps
        return min(by_regs, by_shared, by_warps, target.max_blocks_per_sm)

    def occupancy(self, target: Target) -> float:
        """Resident warps / the SM's maximum: the share of its warp slots this kernel can fill."""
        return self.blocks_per_sm(target) * self.warps / target.max_warps_per_sm


def _tool(name: str) -> str:
    from triton import knobs
    return getattr(knobs.nvidia, name).path


def read_resources(kernel) -> Resources:
    """Registers, spills and stack from `cuobjdump --dump-resource-usage` on the cubin; shared from Triton."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return Resources(int(usage["REG"]), int(usage["LOCAL"]), int(usage["STACK"]), kernel.metadata.shared,
                     kernel.metadata.num_warps)


def compile_for(launch: Launch, target: Target):
    """The launch compiled to a cubin for `target` (raises on a compile error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(launch.kernel, launch.signature, launch.constants, launch.attrs)
    return triton.compile(source, target=GPUTarget("cuda", target.capability, 32),
                          options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})


def ptxas_version() -> str:
    """The bundled ptxas releases, e.g. "12.9 (sm_80), 13.4 (sm_90, sm_100)": Triton picks one per target."""
    def release(tool: str) -> str:
        out = subprocess.run([_tool(tool), "--version"], check=True, capture_output=True, text=True).stdout
        return re.search(r"release (\d+\.\d+)", out)[1]
    return f"{release('ptxas')} (sm_80), {release('ptxas_blackwell')} (sm_90, sm_100)"
