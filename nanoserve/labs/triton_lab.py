"""Lab triton-decode: the online softmax at the heart of the Triton attention kernels, under the interpreter.

The student writes `online_softmax_step(m_i, l_i, acc, s, v)` in a copy of
nanoserve/kernels/triton_common.py: fold one tile of scores into the
running max, sum and output, so that after the last tile acc / l is
softmax(all scores) @ V. The engine's own decode and prefill kernels are then
built around the student's step: `kernels_with` loads the kernels' source
files as fresh modules whose `online_softmax_step` (and `load_kv_tile`) come
from the student's file; the engine's modules are not touched. The checks
compare those kernels with the torch reference (short and long sequences,
several splits, a split past a sequence's end) and run the engine on them.

Triton runs on the CPU under its interpreter (TRITON_INTERPRET=1, which the
lab's worker sets before triton is imported): about 2-3 ms per tile.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from types import ModuleType

import torch

from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, same_as_engine
from nanoserve.labs.lab import Check, Context, Lab, expect

_count = itertools.count()
IMPORT = "from nanoserve.kernels.triton_common import load_kv_tile, online_softmax_step"


def _load_with(name: str, student: ModuleType) -> ModuleType:
    """A fresh copy of the engine's module `name` whose shared Triton helpers are the student's."""
    spec = importlib.util.find_spec(name)
    with open(spec.origin) as f:
        source = f.read()
    assert IMPORT in source, f"{name} no longer imports its helpers as the lab expects"
    module = ModuleType(f"{name}_lab{next(_count)}")
    module.__file__ = spec.origin
    sys.modules[module.__name__] = module            # triton's interpreter reads a function's module
    module.__dict__.update(load_kv_tile=student.load_kv_tile, online_softmax_step=student.online_softmax_step)
    exec(compile(source.replace(IMPORT, ""), spec.origin, "exec"), module.__dict__)
    return module


def kernels_with(student: ModuleType) -> tuple[ModuleType, ModuleType]:
    """(decode module, prefill module) built around the student's helpers."""
    return _load_with("nanoserve.kernels.triton_decode", student), _load_with("nanoserve.kernels.triton_prefill", student)


def _fold(student: ModuleType, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Run the student's step over tiles s [T, R, N], v [T, N, D] inside triton_fold's one-program kernel."""
    fold = _load_with("nanoserve.labs.triton_fold", student)
    out = torch.empty(s.shape[1], v.shape[2])
    fold.fold_kernel[(1,)](s.contiguous(), v.contiguous(), out, TILES=s.shape[0], R=s.shape[1], N=s.shape[2],
                           D=v.shape[2])
    return out


def masked_tile(ctx: Context) -> None:
    """A tile whose scores are all masked (-inf) first, then a real one: the result is the real tile's."""
    _require_interpreter()
    g = torch.Generator().manual_seed(7)
    s = torch.randn(2, 16, 16, generator=g)
    s[0] = float("-inf")                       # every position of the first tile masked
    v = torch.randn(2, 16, 16, generator=g)
    got = _fold(ctx.module, s, v)
    want = torch.softmax(s[1], dim=-1) @ v[1]
    expect(not torch.isnan(got).any(), "after a fully masked tile the output holds NaN",
           "a row that has seen only masked (-inf) scores has m = -inf, and exp(-inf - -inf) is NaN: use a safe "
           "max (0 where the new max is -inf) in both exponents, so p and alpha are 0 there")
    expect(torch.allclose(got, want, atol=1e-4), "a masked tile followed by a real one does not give the real "
           "tile's softmax @ V", "masked positions must add nothing: p = exp(-inf) = 0")


def _require_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("this lab runs Triton under its interpreter: start with TRITON_INTERPRET=1")


def _case(seed: int, lens: list[int], bs: int = 4, hq: int = 4, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-n // bs) for n in lens)
    num_blocks = nb * len(lens) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: nb * len(lens)].view(len(lens), nb)
    k_cache, v_cache = (torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2))
    q = torch.randn(len(lens), hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def _compare(ctx: Context, lens: list[int], what: str, hint: str, **kw) -> None:
    from nanoserve.kernels import reference
    _require_interpreter()
    decode, _ = kernels_with(ctx.module)
    q, k_cache, v_cache, tables, seq_lens = _case(len(lens), lens)
    want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    got = decode.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, **kw)
    expect(not torch.isnan(got).any(), f"{what}: the output holds NaN",
           "a row that has seen only masked (-inf) scores has m = -inf: exp(-inf - -inf) is NaN. Use a safe max "
           "(0 where the new max is -inf) in the exponents")
    err = float((got - want).abs().max())
    expect(err < 1e-3, f"{what}: max difference from the torch reference {err:.3g}", hint)


def one_tile(ctx: Context) -> None:
    _compare(ctx, [5, 9, 3], "sequences shorter than one tile",
             "within one tile: m' = max(m, rowmax s), p = exp(s - m'), l' = l * exp(m - m') + rowsum p, "
             "acc' = acc * exp(m - m') + p @ v", block_n=16)


def many_tiles(ctx: Context) -> None:
    _compare(ctx, [70, 33, 64], "sequences of several tiles",
             "across tiles the old sum and output must be rescaled by alpha = exp(m_old - m_new) before the "
             "new tile is added: forgetting alpha (or applying it to only one of l and acc) is right for one "
             "tile and wrong for several", block_n=16)


def splits(ctx: Context) -> None:
    _compare(ctx, [100, 7], "four splits, some past a sequence's end",
             "a split that only sees masked positions must leave l = 0 and acc = 0 (no NaN): p and alpha are 0 "
             "there", block_n=16, num_splits=4)


def engine_runs(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    _require_interpreter()
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0)) for i, p in enumerate(prompts(2, 11, seed=5))]
    same_as_engine(ctx, reqs, {"num_blocks": 16, "max_num_batched_tokens": 16, "attention_backend": "triton"},
                   "the engine's tokens differ with your step inside its Triton kernels")


def _components(m: ModuleType) -> Components:
    from nanoserve.kernels.backends import make_backend
    from nanoserve.kernels.triton_backend import TritonBackend

    def make(name: str, fast_paths: bool):
        if name != "triton":
            return make_backend(name, fast_paths)
        decode, prefill = kernels_with(m)
        return TritonBackend(decode, prefill)
    return Components(attention_backend=make)


LAB = Lab(
    name="triton-decode",
    title="the Triton attention kernels' inner loop: online softmax, under the interpreter",
    module="nanoserve.kernels.triton_common",
    blanks={"online_softmax_step": "m_new = max(m_i, rowmax s); m_safe = 0 where m_new is -inf else m_new; "
                                   "p = exp(s - m_safe); alpha = exp(m_i - m_safe); l = l * alpha + rowsum p; "
                                   "acc = acc * alpha + dot(p, v) (p cast to v's dtype); return m_new, l, acc"},
    components=_components,
    checks=(
        SIGNATURES,
        Check("one tile equals the reference", one_tile, "fold one tile into (m, l, acc)", 120),
        Check("many tiles equal the reference", many_tiles, "rescale the old l and acc by alpha", 180),
        Check("split-K with empty splits: no NaN", splits, "keep fully masked rows at l = 0 without NaN", 180),
        Check("a fully masked tile: no NaN", masked_tile, "a safe max keeps fully masked rows at 0", 120),
        Check("real engine on the Triton backend: same tokens", engine_runs,
              "run the engine with attention_backend='triton' (TRITON_INTERPRET=1) and your step", 300),
    ),
    prerequisites="softmax and its max trick; lesson 3 (the decode kernel)",
    minutes=40,
)
