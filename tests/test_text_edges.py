"""Text that is not valid Unicode is refused where it comes in: `add_request`, the command line,
SamplingParams' stop strings (the HTTP API: tests/test_serve_survival.py). One helper decides
(`validation.well_formed`); the error is a FieldError naming the field and the code point.

A Python str can hold a lone UTF-16 surrogate: JSON's "\\ud800" parses to one, and a command-line
byte that is not UTF-8 becomes one (U+DC80..U+DCFF). The tokenizer raised TypeError on it, a
trace could not be written, and `nanoserve generate $'hi \\xff'` printed a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.errors import FieldError
from nanoserve.validation import well_formed


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama.name, block_size=4, num_blocks=32), loaded=tiny_llama)


@pytest.mark.parametrize("text, where", [("hi \ud800", 3), ("\udcff", 0), ("ok \U0001F600 \udfff", 5)])
def test_well_formed_names_the_code_point(text, where):
    with pytest.raises(FieldError) as info:
        well_formed("prompt", text)
    assert info.value.field == "prompt" and f"at character {where}" in info.value.text
    assert "lone surrogate U+D" in info.value.text
    str(info.value).encode("utf-8")                      # the message itself is printable


def test_valid_text_passes():
    for text in ("", "hello", "\U0001F600 emoji", "\u00e9t\u00e9", "\ufffd"):
        assert well_formed("prompt", text) == text


@pytest.mark.parametrize("call, field", [
    (lambda e: e.add_request("x", "hi \ud800"), "prompt"),
    (lambda e: e.add_request("\udcff", "hi"), "request_id"),
    (lambda e: e.add_request("x", "hi", SamplingParams(stop=["ok", "\ud83d"])), "stop"),
])
def test_add_request_refuses_it_and_changes_nothing(engine, call, field):
    before = engine.snapshot()
    with pytest.raises(FieldError) as info:
        call(engine)
    assert info.value.field == field and "not valid Unicode" in info.value.text
    assert engine.snapshot() == before
    engine.check_invariants()


def test_generate_with_a_byte_that_is_not_utf8_is_one_line():
    """The real argv path: the OS hands Python bytes, Python decodes them with surrogateescape."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    code = "import sys; from nanoserve.cli import main; sys.exit(main())"
    run = subprocess.run([sys.executable.encode(), b"-c", code.encode(), b"generate", b"hi \xff"],
                         capture_output=True, timeout=300, env=env)
    err = run.stderr.decode("utf-8", "replace").strip()
    assert run.returncode == 2 and "Traceback" not in err, err
    assert err.splitlines() == [
        "nanoserve: error: PROMPT is not valid Unicode text: a lone surrogate U+DCFF (the byte 0xff, "
        "which is not UTF-8) at character 3"]
    assert "loading" not in err                          # refused before the model loads
