"""Loading models safely (issue 12, item 9): no code from a model folder ever runs, the GGUF cache
only ever stands for the exact bytes it was converted from, and an offline machine never calls
the hub; plus the loader's one progress line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
from pathlib import Path

import pytest
from conftest import save_tiny

from nanoserve.cli import main
from nanoserve.models import resolve
from nanoserve.models.loader import load_model


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network at all: HF_HUB_OFFLINE, and a socket that fails the test if anyone connects."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket, "create_connection", no_network)


# -- no code from a model folder runs ---------------------------------------------------------------

def test_model_with_custom_code_is_refused_not_run(tmp_path, offline, capsys):
    path = Path(save_tiny("tiny-llama", tmp_path / "custom"))
    marker = tmp_path / "ran"
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="custom_llama", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                       "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (path / "config.json").write_text(json.dumps(config))
    for module in ("configuration_custom.py", "modeling_custom.py"):
        (path / module).write_text(f"open({str(marker)!r}, 'w').write('this code ran')\n")
    assert main(["generate", "--model", str(path), "Hi"]) == 2
    err = capsys.readouterr().err
    assert "custom code" in err and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickled_weights_cannot_run_code(tmp_path, offline, capsys):
    """A pytorch_model.bin whose pickle would run a command: refused (torch.load weights_only), in one line."""
    path = Path(save_tiny("tiny-llama", tmp_path / "pickled"))
    (path / "model.safetensors").unlink()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}))
    assert main(["generate", "--model", str(path), "Hi"]) == 2
    err = capsys.readouterr().err
    assert f"could not load model '{path}'" in err and "Traceback" not in err
    assert not marker.exists()


# -- the GGUF cache is keyed by content --------------------------------------------------------------

def test_gguf_cache_key_is_the_content(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path, fill in ((a, b"\x01"), (b, b"\x02")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + fill * 1000)
        os.utime(path, (1_700_000_000, 1_700_000_000))        # same name, size and mtime
    assert resolve.gguf_cache_dir(a) != resolve.gguf_cache_dir(b)
    assert resolve.gguf_cache_dir(a).name.startswith("m-")


def test_planted_cache_entry_does_not_make_random_bytes_load(tmp_path, offline, capsys):
    """A working model planted in the cache under every name the old key could give is ignored."""
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + os.urandom(4096))
    stat = fake.stat()
    planted = Path(save_tiny("tiny-llama", tmp_path / "planted"))
    gguf_cache = Path(os.environ["NANOSERVE_CACHE"]) / "gguf"
    for name in (f"model-{stat.st_size}-{int(stat.st_mtime)}", "model"):
        shutil.copytree(planted, gguf_cache / name)
    assert main(["generate", "--model", str(fake), "Hi"]) == 2
    err = capsys.readouterr().err
    assert f"could not read GGUF file {fake}" in err and "Traceback" not in err


# -- offline: no network, and a message that says why ------------------------------------------------

def test_offline_hub_id_says_it_needs_the_hub(offline, capsys):
    assert main(["generate", "--model", "gpt2", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "'gpt2' would come from the Hugging Face hub, which needs internet" in err
    assert "HF_HUB_OFFLINE" in err and "unknown model" not in err and "smollm2" in err


def test_unreachable_hub_says_so(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(resolve, "hub_reachable", lambda timeout=3.0: False)
    assert main(["tui", "--model", "HuggingFaceTB/SmolLM2-135M"]) == 2
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "unknown model" not in err


def test_names_that_cannot_be_hub_ids_are_unknown(offline, capsys):
    assert main(["generate", "--model", "two words", "Hi"]) == 2
    assert "unknown model 'two words'" in capsys.readouterr().err


# -- one progress line of ours ------------------------------------------------------------------------

def test_loading_prints_one_line_of_ours(tmp_path, offline, capsys):
    path = save_tiny("tiny-llama", tmp_path / "m")
    capsys.readouterr()
    loaded = load_model(path)
    err = capsys.readouterr().err
    assert loaded.tokenizer is not None
    assert err.count("\n") == 1 and err.startswith(f"nanoserve: loading {path}") and " done in " in err
    assert "Loading weights" not in err and "%|" not in err          # transformers' own bar is off
