"""Which code runs is decided once, in implementation.py, and said as it ran.

Three kinds of test here:

* choice: `choose()` turns "auto" into the names the config's path and device allow, and the older setting
  names (fast_paths, c_kernels) mean the paths they meant;
* override: `forced_path` makes every runner built inside it run that path, whatever its config, and the
  tokens stay the same on every path (the reading path is the reference the others must equal);
* report: the `Implementation` line names the parts that ran, a lab's attention backend always runs as
  given, and the line is logged once per runner.
"""

from __future__ import annotations

import logging

import pytest
from conftest import make_engine, run_to_end

from nanoserve.config import EngineConfig, current_names
from nanoserve.cpu.backend import CpuBackend
from nanoserve.implementation import Choice, choose, forced_path
from nanoserve.kernels.backends import make_backend
from nanoserve.kernels.torch_backend import TorchBackend
from nanoserve.sampling_params import SamplingParams


def test_auto_becomes_a_name_the_path_allows():
    assert choose(EngineConfig()).attention == "cpu"                 # a CPU on the fast path: the C kernel
    assert choose(EngineConfig(path="torch")).attention == "torch"   # no C files
    assert choose(EngineConfig(path="reading")) == Choice("reading", "torch", None)
    assert choose(EngineConfig(attention_backend="torch")).attention == "torch"
    assert choose(EngineConfig(enforce_eager=False, max_model_len=64)).graphs is not None   # padded, uncaptured


def test_the_older_names_mean_the_paths_they_meant():
    assert EngineConfig(fast_paths=False).path == "reading"
    assert EngineConfig(c_kernels=False).path == "torch"
    assert EngineConfig(fast_paths=False, c_kernels=False).path == "reading"
    assert current_names({"fast_paths": True, "c_kernels": True, "block_size": 4}) == {"block_size": 4,
                                                                                      "path": "fast"}
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="cpu", path="torch")


def test_a_forced_path_runs_whatever_the_config_says(tiny_llama):
    with forced_path("reading"):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    assert engine.implementation.path == "reading" and engine.implementation.model.startswith("Llama ")
    assert type(engine.runner.attn) is TorchBackend and not engine.runner.attn.grouped
    assert make_engine(tiny_llama, block_size=4, num_blocks=64).implementation.path == "fast"   # undone after
    with pytest.raises(ValueError, match="path"), forced_path("quick"):
        pass


def test_every_path_gives_the_same_tokens(tiny_llama):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    prompts = {"a": "The quick brown fox", "b": "Hello", "c": "Once upon a time, in a land far away"}
    tokens = {}
    for path in ("reading", "torch", "fast"):
        with forced_path(path):
            engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, greedy)
        tokens[path] = {rid: out.outputs[0].token_ids for rid, out in run_to_end(engine).items()}
    assert tokens["torch"] == tokens["reading"] and tokens["fast"] == tokens["reading"]


def test_the_line_names_what_ran_and_is_logged_once(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    lines = [r.getMessage() for r in caplog.records if "path:" in r.getMessage()]
    assert lines == [f"nanoserve: {engine.implementation.summary()}"]
    if isinstance(engine.runner.attn, CpuBackend):        # attention.c built here
        assert engine.implementation.attention.startswith("cpu")


def test_a_labs_attention_runs_on_every_path(tiny_llama):
    from nanoserve.components import Components
    from nanoserve.kernels import reference

    made = []

    def make(name: str, grouped: bool):
        made.append((name, grouped))
        return TorchBackend(grouped=grouped, ops=reference) if name == "torch" else make_backend(name, grouped)

    engine = make_engine(tiny_llama, Components(attention_backend=make), block_size=4, num_blocks=64)
    assert made == [("torch", True)] and not isinstance(engine.runner.attn, CpuBackend)
