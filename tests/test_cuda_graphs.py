"""CUDA graphs' bookkeeping on a CPU: the padded static-buffer path run without capture (cuda_graphs.py).

`enforce_eager=False` on a CPU pads every pure-decode step to its batch-size
bucket, pads block tables to max_model_len, copies the step into the bucket's
static buffers and runs the model on those, exactly what a GPU replays; only
the capture is left out. The tokens must equal the eager engine's, the pool's
K/V must be bit-equal (padding rows write only to the scratch block), and the
stats must say which steps took the path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, make_engine, run_to_end

from nanoserve import SamplingParams
from nanoserve.cuda_graphs import GraphSettings, bucket_for, buckets
from nanoserve.errors import FieldError


def test_buckets_cover_max_num_seqs():
    assert buckets(1) == (1,)
    assert buckets(3) == (1, 2, 4)
    assert buckets(20) == (1, 2, 4, 8, 16, 24)
    assert buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    sizes = buckets(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 24)] == [1, 4, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None


def test_settings_follow_enforce_eager():
    config = lambda device, eager, tp=1: SimpleNamespace(device=device, enforce_eager=eager,  # noqa: E731
                                                          tensor_parallel_size=tp, max_num_seqs=8, max_model_len=64)
    assert GraphSettings.from_config(config("cuda", None)) == GraphSettings(8, 64, capture=True)
    assert GraphSettings.from_config(config("cuda:1", False)).capture
    assert GraphSettings.from_config(config("cuda", True)) is None
    assert GraphSettings.from_config(config("cpu", None)) is None                  # a CPU: eager by default
    assert GraphSettings.from_config(config("cpu", False)) == GraphSettings(8, 64, capture=False)
    assert GraphSettings.from_config(config("cuda", None, tp=2)) is None


def test_enforce_eager_must_be_a_boolean(tiny_llama):
    with pytest.raises(FieldError, match="enforce_eager"):
        make_engine(tiny_llama, enforce_eager="yes")


def grow(engine, num_requests: int, every: int = 2) -> tuple[dict, list]:
    """Add a request every `every` steps, so the decode batch grows one by one past several buckets."""
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 5)] for i in range(num_requests)]
    done, stats, step = {}, [], 0
    while prompts or engine.has_unfinished_requests():
        if prompts and step % every == 0:
            engine.add_request(f"r{num_requests - len(prompts)}", prompts.pop(0),
                               SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        result = engine.step()
        engine.check_invariants()
        stats.append(result.stats)
        done.update({o.request_id: o.outputs[0].token_ids for o in result.outputs if o.finished})
        step += 1
    return done, stats


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_padded_path_gives_the_eager_tokens_and_cache(kind, tiny_llama, tiny_gpt2):
    loaded = tiny_llama if kind == "llama" else tiny_gpt2
    settings = dict(block_size=4, num_blocks=200, max_num_seqs=18, max_model_len=64, max_num_batched_tokens=32)
    eager = make_engine(loaded, enforce_eager=True, **settings)
    padded = make_engine(loaded, enforce_eager=False, **settings)
    want, eager_stats = grow(eager, 18)
    got, stats = grow(padded, 18)
    assert got == want
    assert all(s.graph_bucket == 0 for s in eager_stats)
    used = {s.graph_bucket for s in stats}
    assert {1, 2, 4, 8, 16, 24} <= used, f"the workload was meant to grow past every bucket, used {used}"
    for s in stats:      # a step with a prefill chunk runs eagerly; a pure-decode step takes its bucket
        if s.num_prefill_tokens:
            assert s.graph_bucket == 0
        elif s.num_seqs:
            assert s.graph_bucket == bucket_for(s.num_seqs, buckets(18))
    # The pool's K/V are the same: padding rows wrote only to the scratch block past the pool. On a CPU
    # the same bits (a row's matmul does not depend on the rows beside it); cuBLAS may pick another
    # kernel for another row count, so on a GPU (benchmarks/gpu_check.py) the same to rounding.
    same = torch.equal if DEVICE == "cpu" else lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    n = settings["num_blocks"]
    for (k0, v0), (k1, v1) in zip(eager.runner.kv_caches, padded.runner.kv_caches):
        assert k1.shape[0] == n + 1 and same(k0[:n], k1[:n]) and same(v0[:n], v1[:n])


def test_static_buffers_keep_their_addresses(tiny_llama):
    """A graph reads fixed addresses: each bucket's buffers are made once and then only written into."""
    engine = make_engine(tiny_llama, enforce_eager=False, block_size=4, num_blocks=64, max_num_seqs=4,
                         max_model_len=40)
    graphs = engine.runner.graphs
    for i in range(3):
        engine.add_request(f"r{i}", [i + 1, i + 2, i + 3], SamplingParams(max_tokens=6, temperature=0))
    engine.step()                                   # the prefills: eager
    engine.step()                                   # the first decode step of 3: bucket 4's buffers made
    static = graphs.static[4].batch
    addresses = (static.input_ids.data_ptr(), static.positions.data_ptr(), static.meta.slot_mapping.data_ptr())
    engine.step()
    assert engine.runner.replayed_bucket == 4 and graphs.static[4].batch is static
    assert (static.input_ids.data_ptr(), static.positions.data_ptr(), static.meta.slot_mapping.data_ptr()) \
        == addresses
    # This step's values are in them: each sequence's last token at its position, padding row last.
    seqs = [engine.sequences[f"r{i}"] for i in range(3)]
    assert static.input_ids.tolist()[:3] == [s.all_token_ids[-2] for s in seqs]
    assert static.positions.tolist() == [len(s.all_token_ids) - 2 for s in seqs] + [0]
    assert static.meta.slot_mapping[3].item() == graphs.pad_block * 4            # the scratch block's first slot


def test_block_tables_are_max_model_len_wide(tiny_llama):
    """The Triton backend's decode tables: max_model_len / block_size blocks, the scratch block as padding."""
    def finish(engine):
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in run_to_end(engine).values()]

    settings = dict(attention_backend="triton", block_size=4, num_blocks=32, max_num_seqs=2, max_model_len=24)
    padded = make_engine(tiny_llama, enforce_eager=False, **settings)
    assert finish(padded) == finish(make_engine(tiny_llama, **settings))
    tables = padded.runner.graphs.static[1].batch.meta.decode_block_tables
    assert tables.shape == (1, 6)                 # 24 / 4 blocks, whatever the sequence's length
    assert (tables[0, 2:] == 32).all()            # its last decode had 5 tokens: 2 blocks, then the scratch block
