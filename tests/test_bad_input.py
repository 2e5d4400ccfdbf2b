"""Bad input (issue 12, item 7 and the NaN settings of item 3): one `FieldError` naming the field,
nothing changed, and the engine still working afterwards.

`FieldError(field, text)` is a ValueError whose message reads "<field> <text>"; the
command line maps `.field` to its flag. Pools too big for the KV budget or the machine
are refused before anything is allocated.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine
from engine_checks import FoldWatcher, drive, greedy

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.errors import FieldError


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(top_p=float("inf")), "top_p"),
])
def test_nan_and_inf_settings_are_refused(kwargs, field):
    with pytest.raises(FieldError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and "finite" in str(info.value)


def test_stop_token_id_outside_the_vocabulary_is_refused_before_it_is_queued(tiny_llama):
    """Regression: stop_token_ids=[10**6] with min_tokens was accepted and raised inside step()."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    before = engine.snapshot()
    with pytest.raises(FieldError) as info:
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]))
    assert info.value.field == "stop_token_ids" and "outside the vocabulary [0, 257)" in str(info.value)
    assert engine.snapshot() == before and not engine.has_unfinished_requests()


BAD_REQUESTS = [
    (dict(priority="high"), "priority"),
    (dict(priority=1.5), "priority"),
    (dict(params=SamplingParams(stop_token_ids=[300])), "stop_token_ids"),
    (dict(prompt=[1.0, 2.0]), "prompt"),
    (dict(prompt=["1", "2"]), "prompt"),
    (dict(prompt=[True, 2]), "prompt"),
    (dict(prompt=b"hello"), "prompt"),
    (dict(prompt=[1, -3]), "prompt"),
    (dict(prompt=None), "prompt"),
    (dict(prompt=12), "prompt"),
    (dict(request_id=7), "request_id"),
    (dict(request_id=""), "request_id"),
    (dict(params={"max_tokens": 3}), "params"),
    (dict(arrival_time=float("nan")), "arrival_time"),
    (dict(params=SamplingParams(n=9)), "n"),
    (dict(params=SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(257)))), "stop_token_ids"),
]


@pytest.mark.parametrize("bad, field", BAD_REQUESTS)
def test_bad_requests_are_refused_whole(tiny_llama, bad, field):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32, max_num_seqs=4)
    watcher = FoldWatcher(engine)
    engine.add_request("ok", [1, 2, 3], greedy(3))
    before = engine.snapshot()
    args = dict(request_id="bad", prompt=[4, 5], params=greedy(3), **{})
    args.update(bad)
    with pytest.raises(FieldError) as info:
        engine.add_request(args.pop("request_id"), args.pop("prompt"), args.pop("params"), **args)
    assert info.value.field == field and str(info.value).startswith(field + " ")
    assert engine.snapshot() == before
    assert set(drive(engine, watcher)) == {"ok"}


BAD_PARAMS = [
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(stop=[5]), "stop"),
    (dict(stop=b"x"), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids"),
    (dict(stop_token_ids="5"), "stop_token_ids"),
    (dict(top_k="5"), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(logprobs=-1), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(n=2.0), "n"),
    (dict(temperature=None), "temperature"),
    (dict(beam_width=2, temperature=0, top_k=5), "top_k"),
]


@pytest.mark.parametrize("kwargs, field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(FieldError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and str(info.value).startswith(field + " ")


def test_sampling_params_changed_after_add_change_nothing(tiny_llama):
    """The engine keeps its own checked copy: a later change to the caller's object is not seen."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32)
    params = greedy(4)
    engine.add_request("a", [1, 2], params)
    params.temperature = float("nan")
    assert drive(engine)["a"].outputs[0].finish_reason == "length"


BAD_CONFIGS = [
    (dict(block_size=0), "block_size"),
    (dict(block_size=4.0), "block_size"),
    (dict(num_blocks=True), "num_blocks"),
    (dict(max_num_seqs="8"), "max_num_seqs"),
    (dict(kv_cache_memory_mb=float("nan")), "kv_cache_memory_mb"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(dtype="float64"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(seed=-1), "seed"),
    (dict(ngram_min=3, ngram_max=2), "ngram_min"),
    (dict(model=None), "model"),
]


@pytest.mark.parametrize("kwargs, field", BAD_CONFIGS)
def test_bad_engine_configs_name_the_field(kwargs, field):
    with pytest.raises(FieldError) as info:
        EngineConfig(**kwargs)
    assert info.value.field == field and str(info.value).startswith(field + " ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(FieldError, match="no CUDA GPU") as info:
        EngineConfig(device="cuda")
    assert info.value.field == "device"


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_blocks=10**12), "num_blocks"),
    (dict(block_size=2**22), "block_size"),                           # one block above the 256 MB budget
    (dict(kv_cache_memory_mb=2.0**50), "kv_cache_memory_mb"),
    (dict(num_blocks=64, preemption_mode="swap", num_cpu_blocks=10**12), "num_cpu_blocks"),
])
def test_pools_too_big_for_the_budget_or_machine_are_refused_before_allocating(tiny_llama, kwargs, field):
    """Regression: --num-blocks 10**12 grew past 3 GB, block_size=2**22 allocated 2 GiB of KV."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = EngineConfig(model=tiny_llama.name, **kwargs)
    with pytest.raises(FieldError) as info:
        LLMEngine(config, loaded=tiny_llama)
    assert info.value.field == field
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024   # KiB: nothing big allocated
    assert config.num_blocks == kwargs.get("num_blocks")     # the caller's config is left as it was


def test_the_engine_still_works_after_every_bad_input(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=32, max_num_seqs=4)
    watcher = FoldWatcher(engine)
    engine.add_request("a", [1, 2, 3], greedy(5))
    engine.step()
    for bad, _ in BAD_REQUESTS:
        args = dict(request_id="bad", prompt=[4, 5], params=greedy(3))
        args.update(bad)
        with pytest.raises(FieldError):
            engine.add_request(args.pop("request_id"), args.pop("prompt"), args.pop("params"), **args)
        engine.check_invariants()
        watcher.check(engine)
    with pytest.raises(KeyError):
        engine.abort_request("bad")
    with pytest.raises(KeyError):
        engine.fork("bad")
    assert set(drive(engine, watcher)) == {"a"}


def test_the_docs_quote_the_real_messages():
    """docs/concepts/step.md quotes two refusals; they must be what the code says."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "concepts" / "step.md").read_text()
    for kwargs in (dict(max_tokens=2.5), dict(stop=[5])):
        with pytest.raises(FieldError) as info:
            SamplingParams(**kwargs)
        assert f"`{info.value}`" in " ".join(page.split()), str(info.value)
