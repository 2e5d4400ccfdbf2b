"""Bad input and bad files through the command line: one line naming what was wrong, exit code 2,
no traceback (issue 12, item 8), and errors that name the *flag* of a bad setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny

from nanoserve.cli import build_parser, error_line, field_flags, main, subparser
from nanoserve.errors import FieldError

TRACE = Path(__file__).parent / "data" / "tui-memory-pressure.jsonl"


def run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()                      # drop what setting up printed (saving a tiny model)
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def error_of(err: str) -> str:
    """The error line, after checking it is the only line that is not our progress line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if not line.endswith((" failed", " done"))]
    lines = [line for line in lines if not line.startswith("nanoserve: loading ")]
    assert len(lines) == 1 and lines[0].startswith("nanoserve: error: "), err
    return lines[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private conversion cache (NANOSERVE_CACHE) and no network."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


# -- settings name their flag -----------------------------------------------------------------------

def test_every_generate_flag_is_named_after_its_field():
    """`generate`'s engine and sampling groups hold only dataclass fields: the config is built from them."""
    import dataclasses

    from nanoserve.config import EngineConfig
    from nanoserve.sampling_params import SamplingParams

    gen = subparser(build_parser(), "generate")
    groups = {g.title: {getattr(a, "field", a.dest) for a in g._group_actions} for g in gen._action_groups}
    assert groups["engine"] <= {f.name for f in dataclasses.fields(EngineConfig)}
    assert groups["sampling"] <= {f.name for f in dataclasses.fields(SamplingParams)}
    flags = field_flags(gen)
    assert flags["max_num_batched_tokens"] == "--max-batched-tokens" and flags["block_size"] == "--block-size"
    assert flags["speculative_method"] == "--speculative" and flags["n"] == "-n"


@pytest.mark.parametrize("field, flag", [("block_size", "--block-size"), ("max_num_batched_tokens",
                                         "--max-batched-tokens"), ("draft_num_layers", "--draft-layers"),
                                         ("temperature", "--temperature"), ("no_such_field", "no_such_field")])
def test_field_error_names_the_flag(field, flag):
    flags = field_flags(subparser(build_parser(), "generate"))
    line = error_line(FieldError(field, "must be at least 1, got 0"), flags)
    assert line == f"nanoserve: error: {flag} must be at least 1, got 0"


def test_field_error_from_the_config_reaches_the_user_as_a_flag(capsys, monkeypatch):
    import nanoserve.config

    def reject(self, *older_names):    # (EngineConfig's InitVars: fast_paths, c_kernels)
        raise FieldError("max_num_batched_tokens", "must be at least 1, got 0")

    monkeypatch.setattr(nanoserve.config.EngineConfig, "__post_init__", reject)
    code, err = run(capsys, "generate", "--max-batched-tokens", "0", "Hi")
    assert code == 2 and error_of(err) == "nanoserve: error: --max-batched-tokens must be at least 1, got 0"


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--block-size", "0", "Hi"], "block"),
    (["generate", "--threads", "0", "Hi"], "--threads must be at least 1"),
    (["generate", "--temperature", "-1", "Hi"], "temperature"),
    (["generate", "--tensor-parallel-size", "0", "Hi"], "--tensor-parallel-size must be at least 1, got 0"),
    (["generate", "--tp", "3", "Hi"], "--tensor-parallel-size must divide the model's 4 attention heads"),
])
def test_bad_settings_are_one_line(capsys, argv, needle):
    code, err = run(capsys, *argv)
    assert code == 2 and needle in error_of(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(capsys):
    code, err = run(capsys, "generate", "--device", "cuda", "Hi")
    assert code == 2 and "--device is 'cuda' but torch sees no CUDA GPU" in error_of(err)
    code, err = run(capsys, "generate", "--device", "tpu", "Hi")
    assert code == 2 and "--device must be 'cpu', 'cuda'" in error_of(err)


# -- bad model files ---------------------------------------------------------------------------------

def test_truncated_gguf(capsys, cache, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x05" * 20)      # a header cut short
    code, err = run(capsys, "generate", "--model", str(bad), "Hi")
    assert code == 2 and f"could not read GGUF file {bad}" in error_of(err)
    assert not any(cache.rglob("config.json"))                                  # nothing half-written cached


def test_file_that_is_not_gguf(capsys, cache, tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(bytes(range(256)) * 4)
    code, err = run(capsys, "generate", "--model", str(bad), "Hi")
    assert code == 2 and "is not a GGUF file" in error_of(err)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_bad_safetensors(capsys, cache, tmp_path, damage):
    path = Path(save_tiny("tiny-llama", tmp_path / "m"))
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else bytes(reversed(data[:5000])))
    code, err = run(capsys, "generate", "--model", str(path), "Hi")
    assert code == 2 and f"could not load model '{path}'" in error_of(err) and "Safetensor" in err


def test_broken_tokenizer_json(capsys, cache, tmp_path):
    path = Path(save_tiny("tiny-llama", tmp_path / "m"))
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    code, err = run(capsys, "generate", "--model", str(path), "Hi")
    assert code == 2 and "the tokenizer of model" in error_of(err) and "does not load" in err


def test_directory_with_only_a_pickle(capsys, cache, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "model.pkl")
    code, err = run(capsys, "generate", "--model", str(folder), "Hi")
    assert code == 2 and "no config.json" in error_of(err) and "model.pkl" in err


@pytest.mark.parametrize("command", [["record", "-s", "memory-pressure"], ["export", "-t", str(TRACE)]])
def test_output_naming_a_directory(capsys, tmp_path, command):
    code, err = run(capsys, *command, "-o", str(tmp_path))
    assert code == 2 and "--output" in error_of(err) and "is a directory" in err
    code, err = run(capsys, *command, "-o", str(tmp_path / "no" / "such" / "x.jsonl"))
    assert code == 2 and "does not exist" in error_of(err)


# -- bad traces --------------------------------------------------------------------------------------

def edited_trace(tmp_path, line: int, **changes) -> Path:
    """The committed trace with fields of its `line`-th event (1-based) replaced."""
    lines = TRACE.read_text().splitlines()
    event = json.loads(lines[line - 1])
    event.update(changes)
    lines[line - 1] = json.dumps(event)
    path = tmp_path / "edited.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def block_line() -> int:
    return next(i for i, line in enumerate(TRACE.read_text().splitlines(), 1) if "BlocksAllocated" in line)


@pytest.mark.parametrize("changes, needle", [
    (dict(block_ids=[0, 99]), "block 99, outside the pool of 20 blocks"),
    (dict(block_ids=[-1]), "block -1, outside the pool"),
    (dict(block_ids="0 1"), "block_ids should be tuple[int, ...]"),
    (dict(block_ids=[1.5]), "block_ids should be tuple[int, ...]"),
    (dict(request_id=7), "seq_id should be str"),   # (an old trace: its request_id is read as seq_id)
    (dict(step="3"), "step should be int"),
])
def test_bad_trace_in_export_and_replay(capsys, tmp_path, changes, needle):
    from nanoserve_tui.app import run_app

    path = edited_trace(tmp_path, block_line(), **changes)
    code, err = run(capsys, "export", "-t", str(path), "-f", "dot", "-o", str(tmp_path / "x.dot"))
    assert code == 2 and needle in error_of(err) and "BlocksAllocated" in err
    assert run_app(replay=str(path)) == 2
    err = capsys.readouterr().err
    assert needle in error_of(err)


def test_bad_engine_synced(capsys, tmp_path):
    for changes, needle in [(dict(ref_counts=[0, 0]), "ref_counts has 2 entries for 20 blocks"),
                            (dict(num_blocks=-3), "cannot exist"),
                            (dict(requests=[["r0", "waiting", "x", 1, "", 0, 0, [55], 16]]), "block table")]:
        code, err = run(capsys, "export", "-t", str(edited_trace(tmp_path, 1, **changes)), "-f", "dot",
                        "-o", str(tmp_path / "x.dot"))
        assert code == 2 and needle in error_of(err), changes


def test_inconsistent_trace_does_not_replay(capsys, tmp_path):
    """Types and ids fine, but a split of a radix node the trace never made."""
    from nanoserve_tui.app import run_app

    lines = TRACE.read_text().splitlines()
    lines.insert(3, json.dumps({"type": "RadixSplit", "step": 1, "node_id": 999, "new_node_id": 1000,
                                "num_blocks": 1, "head_text": "a", "tail_text": "b"}))
    path = tmp_path / "split.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, err = run(capsys, "export", "-t", str(path), "-f", "dot", "-o", str(tmp_path / "x.dot"))
    assert code == 2 and "do not replay (KeyError: 999)" in error_of(err)
    assert run_app(replay=str(path)) == 2
    assert "do not replay" in error_of(capsys.readouterr().err)


# -- the TUI's install advice ------------------------------------------------------------------------

def test_tui_import_failure_gives_advice_that_works(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "nanoserve_tui.app", None)      # as if textual were missing
    code, err = run(capsys, "tui", "--replay", str(TRACE))
    line = error_of(err)
    assert code == 2 and "pip install 'textual>=0.80'" in line and "[tui]" not in line


# -- fast first contact ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["record", "-s", "nope", "-o", "x.jsonl"],
                                  ["export", "-t", "missing.jsonl"], ["tui", "--model", "/no/such/dir"]])
def test_help_and_errors_never_import_torch(argv, tmp_path):
    code = (f"import sys\nfrom nanoserve.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'textual') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr
