"""The CPU Llama path (cpu/llama.py, cpu/ops.c) against models/llama.py and torch.

* each C op against the torch code it replaces: RMSNorm with the residual add,
  RoPE (bit-equal) and silu(gate) * up, on one row up to a multi-threaded
  batch, widths that are not a multiple of the vector width, extreme inputs;
* bad arguments are refused with a ValueError naming them, before the C code runs;
* the whole model: the same logits as llama.py through the packed view, and the
  same greedy tokens with the CPU path on, off (`path="torch"`) and plain (`path="reading"`);
* where it does not apply (GPT-2, bf16 without bf16 units, a tensor-parallel shard) or cannot be
  built, the runner keeps the torch path;
* the memory hints of cpu/memory.py change nothing but speed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_engine, run_to_end, without_c_compiler

from nanoserve import SamplingParams
from nanoserve.cpu import linear as cpu_linear
from nanoserve.cpu import ops as cpu_ops
from nanoserve.cpu.llama import CpuLlama, supports
from nanoserve.cpu.memory import huge_page_zeros, keep_freed_memory
from nanoserve.implementation import Choice
from nanoserve.models.llama import Llama, RMSNorm, apply_rotary
from nanoserve.runner import ModelRunner, RunInput

ops = cpu_ops.load()
needs_ops = pytest.mark.skipif(ops is None, reason="no C compiler here")


@needs_ops
@pytest.mark.parametrize("rows,dim", [(1, 8), (3, 20), (32, 576), (200, 576)])   # 200 x 576: threads split rows
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_matches_rmsnorm(rows, dim, add):
    torch.manual_seed(rows * dim)
    h, a = torch.randn(rows, dim) * 3, torch.randn(rows, dim)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim)
    want_h = h + a if add else h.clone()
    want = norm(want_h)
    got = ops.add_rms_norm(h, a if add else None, norm.weight.detach(), 1e-5)
    assert torch.equal(h, want_h)                        # the residual add is exact, in place
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)   # only the sum of squares' order differs


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rotary_is_bit_equal_to_apply_rotary_on_the_merged_projection(rows):
    torch.manual_seed(rows)
    Hq, Hkv, D = 4, 2, 16
    qkv = torch.randn(rows, (Hq + 2 * Hkv) * D)
    heads = qkv.view(rows, Hq + 2 * Hkv, D)
    cos, sin = torch.randn(rows, D), torch.randn(rows, D)
    want = apply_rotary(heads[:, : Hq + Hkv], cos, sin)
    v_before = heads[:, Hq + Hkv :].clone()
    ops.rotary_(heads[:, : Hq + Hkv], cos, sin)          # strided rows: v heads sit between them
    assert torch.equal(heads[:, : Hq + Hkv], want)
    assert torch.equal(heads[:, Hq + Hkv :], v_before)   # v is not touched


@needs_ops
@pytest.mark.parametrize("rows,inter", [(1, 3), (7, 33), (32, 1536)])
def test_silu_mul_matches_torch(rows, inter):
    torch.manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 0.0, 90.0])[: min(3, inter)]   # exp far out of range, and 0
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = ops.silu_mul(gate_up)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


ops_bf16 = cpu_ops.load(torch.bfloat16)


def bf16_ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are, element by element (same sign assumed near 0)."""
    as_int = [t.view(torch.int16).to(torch.int32) for t in (got, want)]
    return (as_int[0] - as_int[1]).abs()


@pytest.mark.skipif(ops_bf16 is None, reason="no C compiler here")
@pytest.mark.parametrize("rows,dim", [(1, 8), (3, 20), (32, 576), (200, 576)])
def test_bf16_build_rounds_where_torch_rounds(rows, dim):
    """ops.c built for bf16: RoPE and the residual add bit-equal to llama.py in bf16; RMSNorm and silu * up
    (float32 inside, in another order / with another exp) at most one bf16 step apart, and rarely."""
    torch.manual_seed(rows * dim)
    h, a = (torch.randn(rows, dim) * 3).bfloat16(), torch.randn(rows, dim).bfloat16()
    norm = RMSNorm(dim, 1e-5).bfloat16()
    norm.weight.data = torch.randn(dim).bfloat16()
    want_h = h + a
    want = norm(want_h)
    got = ops_bf16.add_rms_norm(h, a, norm.weight.detach(), 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(h, want_h)
    apart = bf16_ulps_apart(got, want)
    assert apart.max() <= 1 and apart.float().mean() < 0.01
    heads = torch.randn(rows, 12, 16).bfloat16()
    cos, sin = torch.randn(rows, 16), torch.randn(rows, 16)
    want = apply_rotary(heads[:, :8], cos, sin)
    ops_bf16.rotary_(heads[:, :8], cos, sin)
    assert torch.equal(heads[:, :8], want)
    gate_up = (torch.randn(rows, 2 * dim) * 4).bfloat16()
    want = F.silu(gate_up[:, :dim]) * gate_up[:, dim:]
    got = ops_bf16.silu_mul(gate_up)
    apart = bf16_ulps_apart(got, want)
    assert got.dtype == torch.bfloat16 and apart.max() <= 1 and apart.float().mean() < 0.01
    with pytest.raises(ValueError, match="^h: .*bfloat16"):
        ops_bf16.add_rms_norm(h.float(), None, norm.weight.detach(), 1e-5)


@needs_ops
def test_bad_arguments_are_refused_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="^h: .*float32"):
        ops.add_rms_norm(x.double(), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="^a: .*rows of 8"):
        ops.add_rms_norm(x, torch.randn(4, 6), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="^weight"):
        ops.add_rms_norm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="^h: .*contiguous"):
        ops.add_rms_norm(x.t(), None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="^x: .*even head_dim"):
        ops.rotary_(torch.randn(2, 3, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError, match="^cos"):
        ops.rotary_(torch.randn(2, 3, 4), torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="^sin"):
        ops.rotary_(torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="^x: .*side by side"):
        ops.rotary_(torch.randn(2, 4, 3).transpose(1, 2), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="^a: .*rows like h"):
        ops.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="^gate_up: .*even width"):
        ops.silu_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="^gate_up: .*contiguous"):
        ops.silu_mul(torch.randn(6, 2).t())


def prompts_inputs():
    prompts = [[5, 9, 200, 31, 7, 7, 100], [3, 1, 4, 1, 5], [42]]
    return [RunInput(p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]   # blocks of 4 tokens


@needs_ops
def test_cpu_llama_logits_match_the_packed_view(tiny_llama):
    fast = make_engine(tiny_llama, block_size=4, num_blocks=64)
    torch_only = make_engine(tiny_llama, block_size=4, num_blocks=64, path="torch")
    plain = make_engine(tiny_llama, block_size=4, num_blocks=64, path="reading")
    assert isinstance(fast.runner.model, CpuLlama)
    assert not isinstance(torch_only.runner.model, CpuLlama) and not isinstance(plain.runner.model, CpuLlama)
    logits = [e.runner.run(e.runner.prepare(prompts_inputs())) for e in (fast, torch_only, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0], logits[2], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(ops_bf16 is None or not cpu_linear.cpu_has_bf16_units(),
                    reason="needs a CPU with bf16 units (AVX512-BF16, AMX) and a C compiler")
@pytest.mark.parametrize("panels", [True, False])
def test_bf16_cpu_llama_matches_the_reading_path(tiny_llama_dir, panels, monkeypatch):
    """bf16 on a CPU with bf16 units: the CPU Llama path (matmul_bf16.c's panels, or oneDNN-packed bf16
    weights without them; ops.c's bf16 build, the C attention on a bf16 cache) against the reading path, a
    prefill and then a decode step."""
    from nanoserve.cpu import matmul as cpu_matmul
    from nanoserve.models.loader import load_model

    if panels and cpu_matmul.load(torch.bfloat16) is None:
        pytest.skip("matmul_bf16.c needs AVX512-BF16 and a C compiler")
    if not panels:
        monkeypatch.setattr(cpu_matmul, "load", lambda dtype=torch.float32: None)
    loaded = load_model(tiny_llama_dir, torch.bfloat16)
    fast = make_engine(loaded, dtype="bfloat16", block_size=4, num_blocks=64)
    plain = make_engine(loaded, dtype="bfloat16", block_size=4, num_blocks=64, path="reading")
    assert isinstance(fast.runner.model, CpuLlama)
    assert fast.implementation.matmul == ("panels bf16 (cpu/matmul_bf16.c)" if panels
                                          else "oneDNN packed bf16 (cpu/linear.py)")
    prompts = [[5, 9, 200, 31, 7, 7, 100], [3, 1, 4, 1, 5], [42]]
    decode = [RunInput([11 + i], len(p), [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    for step in (prompts_inputs(), decode):
        got, want = (e.runner.run(e.runner.prepare(step)) for e in (fast, plain))
        # bf16 rounding of every layer's output, summed in other orders: close, not bit-equal
        torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=0.1, rtol=0)


@needs_ops
def test_greedy_tokens_equal_with_the_cpu_path_on_and_off(tiny_llama):
    outs = []
    for config in ({}, {"path": "torch"}, {"path": "reading"}):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=16, **config)
        for i in range(5):     # mixed prefill chunks and decodes in one step
            engine.add_request(str(i), list(range(3 + 7 * i, 20 + 9 * i)),
                               SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        outs.append({k: o.outputs[0].token_ids for k, o in run_to_end(engine).items()})
    assert outs[0] == outs[1] == outs[2]


def random_llama(**overrides) -> Llama:
    from transformers import LlamaConfig

    shape = dict(vocab_size=97, hidden_size=40, intermediate_size=52, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = LlamaConfig(**{**shape, **overrides})
    torch.manual_seed(0)
    model = Llama(config).eval()
    with torch.no_grad():                       # norms and biases away from their ones/zeros defaults
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


@needs_ops
@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True},
    {"attention_bias": True, "mlp_bias": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}},
    {"head_dim": 6},                                  # head_dim not hidden / heads; 24-wide attention
    {"num_key_value_heads": 1},                       # every query head reads one KV head
    {"num_key_value_heads": 4},                       # no grouping
], ids=["plain", "tied", "biases", "llama3-rope", "head_dim", "mqa", "mha"])
def test_cpu_llama_matches_llama_on_other_shapes(overrides):
    """Prefill then a decode step through both runners: the same logits to float32 rounding."""
    model = random_llama(**overrides)
    assert supports(model)
    runners = [ModelRunner(model, 16, 4, torch.float32, torch.device("cpu"), Choice(path)) for path in ("fast", "torch")]
    assert isinstance(runners[0].model, CpuLlama) and not isinstance(runners[1].model, CpuLlama)
    prompts = [[5, 9, 20, 31, 7, 7, 60], [3, 1, 4, 1, 5], [42]]
    prefill = [RunInput(p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    decode = [RunInput([11 + i], len(p), [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    for step in (prefill, decode):
        got, want = (r.run(r.prepare(step)) for r in runners)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bf16_units", [True, False])
def test_where_it_does_not_apply(tiny_llama, tiny_gpt2, tiny_llama_dir, monkeypatch, bf16_units):
    from nanoserve.distributed.sharding import shard_model
    from nanoserve.models.loader import load_model

    assert supports(tiny_llama.model)
    assert not supports(tiny_gpt2.model)
    assert not supports(shard_model(tiny_llama.model, 0, 2))
    assert not isinstance(make_engine(tiny_gpt2, block_size=4, num_blocks=64).runner.model, CpuLlama)
    # bf16 only on a CPU that multiplies bf16 in hardware (elsewhere: float32 math on the bf16 values,
    # cpu/linear.py); the question is asked of the CPU, so pretend both kinds here.
    real_units = cpu_linear.cpu_has_bf16_units()
    monkeypatch.setattr(cpu_linear, "cpu_has_bf16_units", lambda: bf16_units)
    bf16 = load_model(tiny_llama_dir, torch.bfloat16)
    assert supports(bf16.model) == bf16_units
    if bf16_units and not real_units:
        return        # oneDNN may refuse to pack bf16 weights for a CPU without bf16 units: build no engine
    engine = make_engine(bf16, dtype="bfloat16", block_size=4, num_blocks=64)
    assert isinstance(engine.runner.model, CpuLlama) == (bf16_units and ops is not None)
    # A module replaced or subclassed anywhere (a student's norm, say) keeps the model's own forward.
    model = random_llama()
    model.model.layers[1].post_attention_layernorm = type("MyNorm", (RMSNorm,), {})(40, 1e-5)
    assert not supports(model)


@needs_ops
def test_a_draft_model_follows_the_engines_switch(tiny_llama):
    """Speculative decoding's draft runner takes the engine's path, as the target's runner does."""
    for path in ("fast", "torch"):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=64, speculative_method="draft",
                             draft_num_layers=1, path=path)
        assert isinstance(engine.runner.model, CpuLlama) == (path == "fast")
        assert isinstance(engine.proposer.runner.model, CpuLlama) == (path == "fast")


def test_a_failed_build_keeps_the_torch_path(tiny_llama, monkeypatch):
    with without_c_compiler(monkeypatch, cpu_ops.load):
        with pytest.warns(UserWarning, match="layers take the torch path"):
            engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
        assert not isinstance(engine.runner.model, CpuLlama)
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        assert len(run_to_end(engine)["r"].outputs[0].token_ids) == 3


@needs_ops
def test_the_loaded_model_is_shared_not_changed(tiny_llama):
    before = {k: v.clone() for k, v in tiny_llama.model.state_dict().items()}
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    view = engine.runner.model
    assert isinstance(view, CpuLlama) and view.embed_tokens is tiny_llama.model.model.embed_tokens   # shared
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0))   # prefill, decodes
    run_to_end(engine)
    after = tiny_llama.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)     # the in-place residual never leaks


def test_memory_hints_change_nothing_but_speed():
    """A smoke test: the hints are requests to glibc and Linux, so what can be checked is the tensors."""
    assert isinstance(keep_freed_memory(), bool)
    t = huge_page_zeros((40, 16, 3, 64 * 64), torch.float32)    # 30 MB: several whole 2 MB pages
    assert t.shape == (40, 16, 3, 64 * 64) and t.dtype == torch.float32 and not t.any()
    small = huge_page_zeros((2, 3), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and not small.any()
