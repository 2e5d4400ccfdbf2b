"""The runner's speed paths (EngineConfig.path="fast") against the plain path they stand beside.

Greedy parity with Hugging Face for both settings is in test_parity.py; here:

* each attention backend builds only the tensors its own kernels read;
* the CPU linear view (cpu/linear.py): oneDNN-packed weights give
  float32 results equal to nn.Linear's up to summation order; bf16 on a CPU
  without bf16 units multiplies in float32 on the bf16 values; the shared
  loaded model stays as it was, and the logits agree with the plain path;
* a bad value for the switch is one clear error naming the field.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine
from torch import nn

from nanoserve import EngineConfig
from nanoserve.attention import BatchLayout, PrefillChunk
from nanoserve.cpu import linear as cpu_linear
from nanoserve.cpu.linear import CpuLinear, PanelLinear, can_pack, cpu_linear_view
from nanoserve.kernels.torch_backend import TorchBackend, TorchMetadata
from nanoserve.runner import RunInput


def layout(bs: int = 4) -> BatchLayout:
    """Two decodes (9 and 3 tokens) and one prefill chunk (5 new tokens after 2 cached)."""
    return BatchLayout(bs, torch.arange(7), [9, 3], [[0, 1, 2], [3]], [PrefillChunk(2, 5, 7, [4, 5])])


def test_torch_backend_builds_only_torch_tensors():
    meta = TorchBackend(grouped=False).prepare(layout())
    assert isinstance(meta, TorchMetadata)
    assert [(g.start, g.end) for g in meta.decode_groups] == [(0, 2)]          # plain: one group
    assert meta.decode_groups[0].block_tables.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert meta.decode_groups[0].mask.shape == (2, 1, 1, 12)
    assert not hasattr(meta, "prefill_query_start")                             # no Triton arrays
    fast = TorchBackend(grouped=True, group_size=1).prepare(layout())
    assert [g.block_tables.tolist() for g in fast.decode_groups] == [[[0, 1, 2]], [[3]]]   # no padding


def test_triton_backend_builds_only_triton_tensors():
    pytest.importorskip("triton")
    from nanoserve.kernels.triton_backend import TritonBackend, TritonMetadata

    meta = TritonBackend().prepare(layout())
    assert isinstance(meta, TritonMetadata)
    assert meta.decode_block_tables.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert meta.prefill_query_start.tolist() == [2] and meta.prefill_context_len.tolist() == [7]
    assert not hasattr(meta, "decode_groups") and not hasattr(meta, "prefills")   # no torch masks


@pytest.mark.parametrize("pack", [False, True])
def test_cpu_linear_view_upcasts_bf16_and_leaves_the_model_alone(pack):
    if pack and not can_pack():
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))).bfloat16()
    view = cpu_linear_view(model, upcast=True, pack=pack)
    assert isinstance(view[0], CpuLinear) and isinstance(view[2][1], CpuLinear)
    assert view[0].packed is pack
    assert isinstance(model[0], nn.Linear) and model[0].weight.dtype == torch.bfloat16       # untouched
    assert view[2][0].weight is model[2][0].weight                          # other parameters shared
    if not pack:
        assert torch.equal(view[0].weight, model[0].weight.float())     # exact copies of bf16 values
    x = torch.randn(5, 8).bfloat16()
    got, want = view(x), model(x)
    assert got.dtype == torch.bfloat16
    # Same products, float32 sums: only the order of the additions (and the bf16 rounding) may differ.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_packed_linear_matches_nn_linear_in_float32():
    if not can_pack():
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = CpuLinear(linear, upcast=False, pack=True)
    for rows in (1, 7, 32, 300):                      # packed for 32 rows; any count works
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 5, 64)                        # leading axes are kept
    torch.testing.assert_close(packed(x3), linear(x3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("has_units", [False, True])
def test_bf16_engine_on_a_cpu_without_bf16_units(tiny_llama_dir, monkeypatch, has_units):
    from nanoserve.models.loader import load_model

    if has_units and not cpu_linear.cpu_has_bf16_units():
        pytest.skip("oneDNN may refuse to pack bf16 weights for a CPU without bf16 units")
    monkeypatch.setattr(cpu_linear, "cpu_has_bf16_units", lambda: has_units)
    loaded = load_model(tiny_llama_dir, torch.bfloat16)
    # (torch attention: the C kernel, the default, reads a bf16 cache with float32 math itself)
    fast = make_engine(loaded, dtype="bfloat16", block_size=4, num_blocks=64, attention_backend="torch")
    plain = make_engine(loaded, dtype="bfloat16", block_size=4, num_blocks=64, path="reading")
    # Only a CPU without bf16 units gets the float32 view; one with them multiplies bf16 weights (in the CPU
    # Llama path, cpu/llama.py): packed in matmul_bf16.c's panels where it builds (AVX512-BF16), else by
    # oneDNN. The loaded model stays bf16 either way.
    linears = [m for m in fast.runner.model.modules() if isinstance(m, CpuLinear)]
    panels = [m for m in fast.runner.model.modules() if isinstance(m, PanelLinear)]
    if has_units:
        assert (panels and not linears) or (linears and not panels)
        assert all(m.packed and not m.upcast and m.weight.dtype == torch.bfloat16 for m in linears)
        assert all(m.weight.dtype == torch.bfloat16 for m in panels)
    else:
        assert linears and not panels and all(m.upcast for m in linears)
    assert fast.runner.attn.compute_dtype == (None if has_units else torch.float32)
    assert not any(isinstance(m, CpuLinear) for m in plain.runner.model.modules())
    assert all(m.weight.dtype == torch.bfloat16 for m in loaded.model.modules() if isinstance(m, nn.Linear))
    prompts = [[5, 9, 200, 31, 7, 7, 100], [3, 1, 4, 1, 5], [42]]
    inputs = [RunInput(p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]   # blocks of 4 tokens
    logits = [e.runner.run(e.runner.prepare(inputs)) for e in (fast, plain)]
    assert logits[0].shape == (3, loaded.model.config.vocab_size)
    # bf16 rounding of every layer's output: close, not bit-equal.
    torch.testing.assert_close(logits[0].log_softmax(-1), logits[1].log_softmax(-1), atol=0.1, rtol=0)


def test_path_is_one_of_three_and_its_older_names_still_read():
    with pytest.raises(ValueError, match="path"):
        EngineConfig(path="quick")
    with pytest.raises(ValueError, match="fast_paths"):
        EngineConfig(fast_paths="yes")
    assert EngineConfig(fast_paths=False).path == "reading" and EngineConfig(c_kernels=False).path == "torch"


def test_fp32_view_has_its_own_hooks():
    """A hook on the view (e.g. benchmarks/profile_step.py's timers) does not fire on the shared original."""
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)).bfloat16()
    view = cpu_linear_view(model, upcast=True, pack=False)
    calls = []
    view[0].register_forward_hook(lambda *a: calls.append(1))
    model(torch.randn(2, 4).bfloat16())
    assert calls == []
    view(torch.randn(2, 4).bfloat16())
    assert calls == [1]
