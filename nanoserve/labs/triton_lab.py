"""Lab triton-decode: the online softmax at the heart of the Triton attention kernels, under the interpreter.

The student writes `online_softmax_step(m_i, l_i, acc, s, v)` in a copy of
nanoserve/kernels/triton_common.py: fold one tile of scores into the
running max, sum and output, so that after the last tile acc / l is
softmax(all scores) @ V. Triton inlines the step into the kernels that call
it, so every kernel around it is built and run in the lab's worker
(`triton_kernels.py`); the checks here send tensors, get tensors back and
compare them with torch: one step on its own (new max, sum and output
separately), several tiles, a fully masked tile, then the engine's own decode
kernel (short and long sequences, several splits, a split past a sequence's
end) and the engine on the Triton backend.

Triton runs on the CPU under its interpreter (TRITON_INTERPRET=1, which the
lab's worker sets before triton is imported): about 2-3 ms per tile.
"""

from __future__ import annotations

import torch

from nanoserve.components import Components
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts, same_as_engine
from nanoserve.labs.lab import Check, Context, Lab, expect
from nanoserve_labkit.remote import worker_helper

KERNELS = "nanoserve.labs.triton_kernels"
INF = float("inf")


def _reference_step(m, l, acc, s, v):
    """online_softmax_step in torch, with the safe max (rows that saw only -inf stay at l = 0, acc = 0)."""
    m_new = torch.maximum(m, s.max(dim=1).values)
    m_safe = torch.where(m_new == -INF, torch.zeros_like(m_new), m_new)
    p = torch.exp(s - m_safe[:, None])
    alpha = torch.exp(m - m_safe)
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


STEP_HINT = ('online softmax: when a tile raises the running max, what must happen to the sum and the accumulator'
             ' computed against the old max? Think of a row whose scores so far are all -inf (no NaN may appear),'
             ' and check what you return')


def one_step(ctx: Context) -> None:
    """The step alone: its three outputs against torch, from an empty state, a running one, and masked rows."""
    g = torch.Generator().manual_seed(3)
    R = N = D = 16
    s, v = torch.randn(R, N, generator=g), torch.randn(N, D, generator=g)
    empty = (torch.full((R,), -INF), torch.zeros(R), torch.zeros(R, D))
    m = torch.randn(R, generator=g) + torch.tensor([3.0, -3.0] * (R // 2))     # above and below the tile's max
    running = (m, torch.rand(R, generator=g) + 0.5, torch.randn(R, D, generator=g))
    masked_s = s.clone()
    masked_s[::2] = -INF                           # even rows: a fully masked tile
    half_empty = (torch.where(torch.arange(R) % 4 == 0, torch.tensor(-INF), m), running[1] *
                  (torch.arange(R) % 4 != 0), running[2] * (torch.arange(R) % 4 != 0)[:, None])
    for state, tile, what in ((empty, s, "the first tile (m = -inf, l = 0, acc = 0)"),
                              (running, s, "a tile after others (m above and below the tile's max)"),
                              (half_empty, masked_s, "fully masked rows (s = -inf), some with nothing seen yet")):
        got = ctx.helper(f"{KERNELS}:step_once", ctx.module, *state, tile, v)
        want = _reference_step(*state, tile, v)
        for name, g_, w, why in (("m_new", got[0], want[0], "m_new = max(m_i, rowmax s)"),
                                 ("l", got[1], want[1], "l = l_i * alpha + rowsum p, alpha = exp(m_i - m_safe)"),
                                 ("acc", got[2], want[2], "acc = acc * alpha + p @ v (p cast to v's dtype)")):
            expect(not torch.isnan(g_).any(), f"one step on {what}: {name} holds NaN",
                   "a row that has seen only masked (-inf) scores has m = -inf, and exp(-inf - -inf) is NaN: use a "
                   "safe max (0 where the new max is -inf) in both exponents, so p and alpha are 0 there")
            close = torch.allclose(g_, w, rtol=1e-4, atol=1e-4, equal_nan=False) or torch.equal(g_, w)
            expect(close, f"one step on {what}: {name} differs from torch by {float((g_ - w).abs().nan_to_num(INF).max()):.3g}",
                   f"{why}. The whole step: {STEP_HINT}")


def masked_tile(ctx: Context) -> None:
    """A tile whose scores are all masked (-inf) first, then a real one: the result is the real tile's."""
    g = torch.Generator().manual_seed(7)
    s = torch.randn(2, 16, 16, generator=g)
    s[0] = float("-inf")                       # every position of the first tile masked
    v = torch.randn(2, 16, 16, generator=g)
    got = ctx.helper(f"{KERNELS}:fold", ctx.module, s, v)
    want = torch.softmax(s[1], dim=-1) @ v[1]
    expect(not torch.isnan(got).any(), "after a fully masked tile the output holds NaN",
           "a row that has seen only masked (-inf) scores has m = -inf, and exp(-inf - -inf) is NaN: use a safe "
           "max (0 where the new max is -inf) in both exponents, so p and alpha are 0 there")
    expect(torch.allclose(got, want, atol=1e-4), "a masked tile followed by a real one does not give the real "
           "tile's softmax @ V", "masked positions must add nothing: p = exp(-inf) = 0")


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
    q, k_cache, v_cache, tables, seq_lens = _case(len(lens), lens)
    want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    got = ctx.helper(f"{KERNELS}:decode", ctx.module, q, k_cache, v_cache, tables, seq_lens, 0.25, **kw)
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
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0)) for i, p in enumerate(prompts(2, 11, seed=5))]
    same_as_engine(ctx, reqs, {"num_blocks": 16, "max_num_batched_tokens": 16, "attention_backend": "triton"},
                   "the engine's tokens differ with your step inside its Triton kernels")


def _components(m) -> Components:
    from nanoserve.kernels.backends import make_backend
    from nanoserve.kernels.triton_backend import TritonBackend

    def make(name: str, grouped: bool):
        if name != "triton":
            return make_backend(name, grouped)
        decode, prefill = worker_helper(m, f"{KERNELS}:kernels_with")   # built where the student's code runs
        return TritonBackend(decode, prefill)
    return Components(attention_backend=make)


LAB = Lab(
    name="triton-decode",
    title="the Triton attention kernels' inner loop: online softmax, under the interpreter",
    module="nanoserve.kernels.triton_common",
    blanks={"online_softmax_step": "m_new = max(m_i, rowmax s); m_safe = 0 where m_new is -inf else m_new; "
                                   "p = exp(s - m_safe); alpha = exp(m_i - m_safe); l = l * alpha + rowsum p; "
                                   "acc = acc * alpha + dot(p, v) (p cast to v's dtype); return m_new, l, acc"},
    contracts={"online_softmax_step": "Given the running row max m_i, row sum l_i and output acc of the tiles "
                                      "so far, and a new tile of scores s (-inf where masked) and values v, "
                                      "returns them for all tiles so far, so that after the last tile acc / l "
                                      "is softmax(all scores) @ V. A row that has seen only -inf keeps l = 0 "
                                      "and acc = 0, never NaN."},
    invariants="After any number of tiles: m = the max score seen per row; l = sum of exp(score - m); acc = "
               "sum of exp(score - m) * v. Masked scores are -inf and add nothing.",
    worker_imports=("triton", KERNELS),
    components=_components,
    checks=(
        SIGNATURES,
        Check("online_softmax_step: one step, m, l and acc", one_step, STEP_HINT, 120,
              function="online_softmax_step"),
        Check("online_softmax_step: a fully masked tile, no NaN", masked_tile,
              "a safe max keeps fully masked rows at 0", 120, function="online_softmax_step"),
        Check("online_softmax_step: one tile in the decode kernel", one_tile, "fold one tile into (m, l, acc)", 120,
              function="online_softmax_step"),
        Check("online_softmax_step: many tiles in the decode kernel", many_tiles,
              "rescale the old l and acc by alpha", 180, function="online_softmax_step"),
        Check("online_softmax_step: split-K with empty splits, no NaN", splits,
              "keep fully masked rows at l = 0 without NaN", 180, function="online_softmax_step"),
        Check("real engine on the Triton backend: same tokens", engine_runs,
              "run the engine with attention_backend='triton' (TRITON_INTERPRET=1) and your step", 300),
    ),
    why=(
        ("Why keep a running max at all, instead of exp(s) directly?",
         "exp of a score of 90 overflows float32 (and float16 overflows above about 11): subtracting the row "
         "max keeps every exponent at or below 0. The max changes tile by tile, so the sums so far are "
         "rescaled by alpha = exp(m_old - m_new) whenever it does."),
        ("Why does a fully masked row need a 'safe' max?",
         "Its max is -inf, and exp(-inf - (-inf)) is exp(NaN). With 0 in place of the max, p = exp(-inf) = 0 "
         "and alpha = exp(-inf) = 0: the row keeps l = 0 and acc = 0, and the split-K combine simply ignores "
         "it."),
        ("Why does this make split-K possible?",
         "(m, l, acc) of two halves of a row combine exactly like a step does: rescale both to the larger max "
         "and add. Splits of a long sequence run in parallel programs and are merged at the end."),
    ),
    prerequisites="softmax and its max trick; lesson 3 (the decode kernel)",
    minutes=40,
)
