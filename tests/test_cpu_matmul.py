"""cpu/matmul.c: the CPU Llama path's matmul from panels of 16 or 32 columns, against torch.

* equal to x @ W.T + b in float64 to float32 rounding, for row counts of a decode step and of prefill
  chunks (past one row block), widths that end inside a panel, rows of any stride;
* a row's result does not depend on the batch around it or the thread count (one running sum per output);
* bad arguments raise ValueError naming the argument before any C code runs;
* PanelLinear is what the CPU Llama path multiplies with, and it keeps oneDNN's CpuLinear where the
  matmul cannot be built.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, run_to_end, without_c_compiler
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nanoserve import SamplingParams
from nanoserve.cpu import matmul as cpu_matmul
from nanoserve.cpu import ops as cpu_ops
from nanoserve.cpu.build import _cpu_features
from nanoserve.cpu.linear import CpuLinear, PanelLinear
from nanoserve.cpu.llama import CpuLlama

mm = cpu_matmul.load()
needs_matmul = pytest.mark.skipif(mm is None, reason="no C compiler: cpu_matmul.c cannot be built")


def reference(x, w, b=None):
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


def close(got, want):
    """float32 rounding of a k-term sum: scaled by the terms' magnitudes, not by the result's."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


@needs_matmul
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), out=st.integers(1, 70), inner=st.integers(1, 90), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_torch_on_any_shape(rows, out, inner, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, inner, generator=g), torch.randn(out, inner, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    close(mm.linear(x, mm.pack(w), out, b), reference(x, w, b))


@needs_matmul
def test_empty_shapes():
    """No rows, or no inputs (then y is the bias): nothing read past the ends, the right shape back."""
    w, b = torch.randn(20, 8), torch.randn(20)
    assert mm.linear(torch.randn(0, 8), mm.pack(w), 20, b).shape == (0, 20)
    y = mm.linear(torch.randn(3, 0), mm.pack(torch.randn(20, 0)), 20, b)
    assert torch.equal(y, b.expand(3, 20))


@needs_matmul
@pytest.mark.parametrize("rows", [32, 200, 700])      # a decode batch; prefill chunks of one and several blocks
def test_matches_torch_at_model_sizes(rows):
    torch.manual_seed(rows)
    for out, inner in [(200, 576), (72, 1536)]:        # 1536 floats: a row block of 64 rows (cpu_matmul.c)
        x, w, b = torch.randn(rows, inner), torch.randn(out, inner), torch.randn(out)
        close(mm.linear(x, mm.pack(w), out, b), reference(x, w, b))


@needs_matmul
def test_rows_of_any_stride():
    """x may be a column slice of a wider tensor (rows apart), as long as each row is contiguous."""
    torch.manual_seed(0)
    wide, w = torch.randn(9, 50), torch.randn(20, 30)
    x = wide[:, 5:35]
    assert not x.is_contiguous()
    close(mm.linear(x, mm.pack(w), 20), reference(x, w))


@needs_matmul
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads():
    torch.manual_seed(1)
    w, b = torch.randn(100, 64), torch.randn(100)
    packed = mm.pack(w)
    batch = torch.randn(33, 64)
    full = mm.linear(batch, packed, 100, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = mm.linear(batch, packed, 100, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for i in (0, 7, 32):                              # alone, and inside tiles of other heights
        assert torch.equal(mm.linear(batch[i:i + 1], packed, 100, b), full[i:i + 1])
        assert torch.equal(mm.linear(batch[i:i + 5], packed, 100, b), full[i:i + 5][: min(5, 33 - i)])


@needs_matmul
def test_the_packed_layout_is_panels_of_two_vectors():
    P = mm.panel                                      # two of this CPU's widest vectors: 16 floats, or 32 (AVX-512)
    assert P == (32 if " avx512f " in f" {_cpu_features()} " else 16)      # -march=native: this CPU's flags
    w = torch.arange((2 * P + 8) * 3, dtype=torch.float32).view(2 * P + 8, 3)
    packed = mm.pack(w)
    assert packed.shape == (3, 3, P)
    assert torch.equal(packed[0], w[:P].T) and torch.equal(packed[1], w[P:2 * P].T)
    assert torch.equal(packed[2, :, :8], w[2 * P:].T) and not packed[2, :, 8:].any()    # zeros past the last row


@needs_matmul
def test_bad_arguments_are_refused_by_name():
    w = torch.randn(20, 8)
    packed = mm.pack(w)
    with pytest.raises(ValueError, match="^x:"):
        mm.linear(torch.randn(4, 8, dtype=torch.float64), packed, 20)
    with pytest.raises(ValueError, match="^x:"):
        mm.linear(torch.randn(8, 4).T, packed, 20)                  # columns apart
    with pytest.raises(ValueError, match="^packed:"):
        mm.linear(torch.randn(4, 9), packed, 20)                    # 9 inputs, a weight of 8
    with pytest.raises(ValueError, match="^packed:"):
        mm.linear(torch.randn(4, 8), packed, 40)                    # more outputs than it holds
    with pytest.raises(ValueError, match="^bias:"):
        mm.linear(torch.randn(4, 8), packed, 20, torch.randn(21))
    with pytest.raises(ValueError, match="^weight:"):
        mm.pack(torch.randn(20, 8, dtype=torch.bfloat16))
    layer = PanelLinear(nn.Linear(8, 20), mm)
    with pytest.raises(ValueError, match="^packed:"):
        layer(torch.randn(4, 9))                                     # the module's quick check, then the named one


@needs_matmul
def test_panel_linear_is_the_linear_it_was_built_from():
    torch.manual_seed(2)
    linear = nn.Linear(48, 37)
    x = torch.randn(6, 48)
    close(PanelLinear(linear, mm)(x), reference(x, linear.weight.detach(), linear.bias.detach()))


@needs_matmul
def test_the_cpu_llama_path_multiplies_with_it(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    model = engine.runner.model
    assert isinstance(model, CpuLlama)
    assert isinstance(model.lm_head, PanelLinear) and isinstance(model.layers[0].qkv, PanelLinear)


def test_without_it_the_cpu_llama_path_keeps_onednn(tiny_llama, monkeypatch):
    if cpu_ops.load() is None:
        pytest.skip("no C compiler: the CPU Llama path is off altogether")
    outputs = []
    for build in (True, False):      # built first: $CC stays broken until the test ends
        if build:
            engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
            assert isinstance(engine.runner.model.layers[0].qkv, PanelLinear)
        else:
            with without_c_compiler(monkeypatch, cpu_matmul.load):   # cpu_ops.load keeps its built library
                with pytest.warns(UserWarning, match="linear layers use oneDNN"):
                    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
                assert isinstance(engine.runner.model, CpuLlama)
                assert isinstance(engine.runner.model.layers[0].qkv, CpuLinear)
        engine.add_request("r", [5, 9, 200, 31, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        outputs.append(run_to_end(engine)["r"].outputs[0].token_ids)
    assert outputs[0] == outputs[1]


# -- bf16 (matmul_bf16.c, on a CPU with AVX512-BF16) ---------------------------------------------

mm16 = cpu_matmul.load(torch.bfloat16)
needs_bf16_matmul = pytest.mark.skipif(mm16 is None, reason="matmul_bf16.c needs AVX512-BF16 and a C compiler")


def close_bf16(got, want):
    """Sums of exact bf16 products in float32, rounded once to bf16: within half a bf16 step (2^-8 of the
    value, relative) plus float32 rounding of the sum, scaled by the terms' magnitudes."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= 2**-8 * want.abs() + 1e-5 * max(1.0, want.abs().max().item())).all(), err.max().item()


@needs_bf16_matmul
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), out=st.integers(1, 70), inner=st.integers(1, 90), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_bf16_matches_torch_on_any_shape(rows, out, inner, bias, seed):
    g = torch.Generator().manual_seed(seed)       # odd widths too: the last pair of k holds one value
    x, w = torch.randn(rows, inner, generator=g).bfloat16(), torch.randn(out, inner, generator=g).bfloat16()
    b = torch.randn(out, generator=g) if bias else None            # the bias is float32
    close_bf16(mm16.linear(x, mm16.pack(w), out, b), reference(x, w, b))


@needs_bf16_matmul
@pytest.mark.parametrize("rows", [1, 8, 32, 300, 600])
def test_bf16_matches_torch_at_model_sizes(rows):
    g = torch.Generator().manual_seed(rows)       # 600 rows of 1536: past one row block
    for out, inner in [(960, 576), (576, 1536)]:
        x, w = torch.randn(rows, inner, generator=g).bfloat16(), torch.randn(out, inner, generator=g).bfloat16()
        close_bf16(mm16.linear(x, mm16.pack(w), out), reference(x, w))


@needs_bf16_matmul
def test_bf16_rows_of_any_stride_and_pairs_along_k():
    w = torch.arange(35 * 5, dtype=torch.float32).view(35, 5).bfloat16()
    packed = mm16.pack(w)                         # [panels, ceil(5 / 2), 32, 2]: W's columns in pairs of k
    assert packed.shape == (2, 3, 32, 2)
    assert torch.equal(packed[0, 1, 7], w[7, 2:4]) and torch.equal(packed[0, 2, 7], torch.stack([w[7, 4], w[7, 4] * 0]))
    assert torch.equal(packed[1, :, :3].permute(1, 0, 2).reshape(3, 6)[:, :5], w[32:])
    assert not packed[1, :, 3:].any()             # zeros past the last row
    wide = torch.randn(6, 20).bfloat16()
    rows = wide[:, 3:8]                           # rows 20 apart
    close_bf16(mm16.linear(rows, packed, 35), reference(rows, w))


@needs_bf16_matmul
def test_bf16_bad_arguments_are_refused_by_name():
    packed = mm16.pack(torch.randn(20, 8).bfloat16())
    with pytest.raises(ValueError, match="^x: expected a bfloat16"):
        mm16.linear(torch.randn(4, 8), packed, 20)                 # float32 rows
    with pytest.raises(ValueError, match="^packed:"):
        mm16.linear(torch.randn(4, 10).bfloat16(), packed, 20)     # 10 inputs, a weight of 8
    with pytest.raises(ValueError, match="^bias:"):
        mm16.linear(torch.randn(4, 8).bfloat16(), packed, 20, torch.randn(20).bfloat16())   # float32 only
    with pytest.raises(ValueError, match="^weight:"):
        mm16.pack(torch.randn(20, 8))


@needs_bf16_matmul
def test_bf16_panel_linear_is_the_linear_it_was_built_from():
    torch.manual_seed(3)
    linear = nn.Linear(48, 37).bfloat16()
    x = torch.randn(6, 48).bfloat16()
    layer = PanelLinear(linear, mm16)
    close_bf16(layer(x), reference(x, linear.weight.detach(), linear.bias.detach()))
    with pytest.raises(ValueError, match="^x:"):
        layer(x.float())
