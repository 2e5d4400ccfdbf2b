"""CpuLlama's layers in one C call (cpu/forward.c) against its Python loop over the same C functions.

* the same bits: logits of a prefill and a decode step, float32 on several shapes (biases, a head_dim
  that is not hidden / heads, one KV head, no grouping) and bf16 on a CPU with bf16 units;
* the same greedy tokens through the engine, a single request and mixed prefill chunks with decodes;
* it runs only where every call of a layer is C: the "cpu" attention backend, panels, no QK-norm,
  and the engine says so (`Implementation.model`);
* a slot, a length or a block id out of range is refused with the ValueError the Python faces raise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, run_to_end
from test_cpu_llama import random_llama

from nanoserve import SamplingParams
from nanoserve.cpu import forward as cpu_forward
from nanoserve.cpu import linear as cpu_linear
from nanoserve.cpu import matmul as cpu_matmul
from nanoserve.cpu import ops as cpu_ops
from nanoserve.cpu.llama import CpuLlama
from nanoserve.implementation import Choice
from nanoserve.runner import ModelRunner, RunInput

built = cpu_ops.load() is not None and cpu_matmul.load() is not None and cpu_forward.library() is not None
needs_c = pytest.mark.skipif(not built, reason="no C compiler here")


def steps(prompts: list[list[int]]) -> list[list[RunInput]]:
    """A prefill of every prompt, then two decode steps (blocks of 4 tokens, 3 per sequence)."""
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(prompts))]
    out = [[RunInput(p, 0, t) for p, t in zip(prompts, tables)]]
    for k in range(2):
        out.append([RunInput([11 + i + k], len(p) + k, t) for i, (p, t) in enumerate(zip(prompts, tables))])
    return out


def both_ways(runner: ModelRunner, batches: list[list[RunInput]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's logits with the one call and with the Python loop, from the same cache state."""
    model = runner.model
    one_call = model.one_call
    assert one_call is not None
    results = []
    for batch in batches:
        prepared = runner.prepare(batch)
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        fused = runner.run(prepared)
        after = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):          # the same start for the loop
            k.copy_(k0)
            v.copy_(v0)
        model.one_call = None
        try:
            loop = runner.run(prepared)
        finally:
            model.one_call = one_call
        for (k, v), (k1, v1) in zip(runner.kv_caches, after):           # ... and the same K/V written
            assert torch.equal(k, k1) and torch.equal(v, v1)
        results.append((fused, loop))
    return results


@needs_c
@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": True, "mlp_bias": True},
    {"head_dim": 6},
    {"num_key_value_heads": 1},
    {"num_key_value_heads": 4},
    {"sliding_window": 3},                            # every layer sees only its last 3 tokens (Mistral's)
], ids=["plain", "biases", "head_dim", "mqa", "mha", "window"])
def test_one_call_is_bit_equal_to_the_python_loop(overrides):
    model = random_llama(**overrides)
    runner = ModelRunner(model, 16, 4, torch.float32, torch.device("cpu"), Choice("fast", "cpu"))
    assert isinstance(runner.model, CpuLlama) and runner.model.one_call is not None
    assert [layer.window for layer in runner.model.layers] == [overrides.get("sliding_window")] * 2
    for fused, loop in both_ways(runner, steps([[5, 9, 20, 31, 7, 7, 60], [3, 1, 4, 1, 5], [42]])):
        assert torch.equal(fused, loop)
    for fused, loop in both_ways(runner, steps([[8, 2, 9]])):             # one sequence: a learner's chat
        assert torch.equal(fused, loop)


@pytest.mark.skipif(not built or cpu_matmul.load(torch.bfloat16) is None or not cpu_linear.cpu_has_bf16_units(),
                    reason="needs AVX512-BF16 (matmul_bf16.c) and a C compiler")
def test_bf16_one_call_is_bit_equal_to_the_python_loop(tiny_llama_dir):
    from nanoserve.models.loader import load_model

    loaded = load_model(tiny_llama_dir, torch.bfloat16)
    engine = make_engine(loaded, dtype="bfloat16", block_size=4, num_blocks=64)
    assert engine.runner.model.one_call is not None
    for prompts in ([[5, 9, 200, 31, 7, 7, 100], [3, 1, 4, 1, 5], [42]], [[7, 7, 7, 1]]):
        for fused, loop in both_ways(engine.runner, steps(prompts)):
            assert torch.equal(fused, loop)


@needs_c
def test_greedy_tokens_equal_the_reading_path(tiny_llama):
    """Through the engine: one request alone, then five with chunked prefills beside decodes."""
    for n, budget in ((1, 64), (5, 16)):
        outs = []
        for config in ({}, {"path": "reading"}):
            engine = make_engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=budget, **config)
            assert (getattr(engine.runner.model, "one_call", None) is not None) == (config == {})
            for i in range(n):
                engine.add_request(str(i), list(range(3 + 7 * i, 20 + 9 * i)),
                                   SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            outs.append({k: (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                         for k, o in run_to_end(engine).items()})
        assert [t for t, _ in outs[0].values()] == [t for t, _ in outs[1].values()]
        for (_, a), (_, b) in zip(outs[0].values(), outs[1].values()):
            assert a == pytest.approx(b, abs=1e-3)


@needs_c
def test_it_runs_only_where_every_call_is_c_and_says_so(tiny_llama):
    fast = make_engine(tiny_llama, block_size=4, num_blocks=64)
    assert "one C call (cpu/forward.c)" in fast.implementation.model
    for config in ({"attention_backend": "torch"}, {"path": "torch"}, {"path": "reading"}):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=64, **config)
        assert getattr(engine.runner.model, "one_call", None) is None
        assert "forward.c" not in engine.implementation.model
    from nanoserve.cpu.llama import cpu_llama_view

    view = cpu_llama_view(random_llama())      # a QK-norm (Qwen3's) is torch between the matmul and RoPE
    assert cpu_forward.OneCall.build(view) is not None
    view.layers[0].qk_norms = (torch.nn.Identity(), torch.nn.Identity())
    assert cpu_forward.OneCall.build(view) is None


@needs_c
@pytest.mark.parametrize("what", ["slot_mapping", "seq_lens", "block_tables"])
def test_bad_indices_are_refused_by_name(what):
    runner = ModelRunner(random_llama(), 16, 4, torch.float32, torch.device("cpu"), Choice("fast", "cpu"))
    batch = runner.prepare([RunInput([5, 9, 20], 0, [0])])
    if what == "slot_mapping":
        batch.meta.slot_mapping[1] = 16 * 4          # one past the pool's last slot
    elif what == "seq_lens":
        batch.meta.seq_lens[2] = 5                   # more tokens than its one block holds
    else:
        batch.meta.block_tables[0, 0] = 16           # no such block
    with pytest.raises(ValueError, match=what):
        runner.run(batch)
