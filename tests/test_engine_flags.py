"""Engine flags have one source: every command that builds an engine has a flag for every EngineConfig field.

The flags are made from `dataclasses.fields(EngineConfig)` (nanoserve/engine_flags.py), so these are
properties of that one source: each command offers every field, with the dataclass's default, and a
typed flag reaches the engine's config (and only a typed one: a scenario's own settings hold otherwise).
"""

from __future__ import annotations

import dataclasses

import pytest

from nanoserve.cli import build_parser, subparser
from nanoserve.config import EngineConfig
from nanoserve.engine_flags import FLAGS, Setting, command_line, engine_settings

ENGINE_COMMANDS = ("generate", "serve", "tui", "record", "compare", "web")
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def engine_actions(command: str) -> dict[str, list]:
    """EngineConfig field -> the engine flags of `command` that set it (and the command's own --model)."""
    actions: dict[str, list] = {}
    for action in subparser(build_parser(), command)._actions:
        field = action.field if isinstance(action, Setting) else "model" if action.dest == "model" else None
        if field is not None:
            actions.setdefault(field, []).append(action)
    return actions


def test_the_help_table_names_exactly_the_fields():
    assert set(FLAGS) == set(FIELDS)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_field_has_a_flag_with_the_dataclass_default(command):
    actions = engine_actions(command)
    assert set(actions) == set(FIELDS), f"`{command}` has no flag for {sorted(set(FIELDS) - set(actions))}"
    for name, field in FIELDS.items():
        if name == "model":     # tui and web: no --model means a replay or the default; the command says
            continue
        for action in actions[name]:
            assert action.default == field.default, f"`{command}` {action.option_strings}: {action.default!r}"


@pytest.mark.parametrize("command, argv", [
    ("generate", ["Hi"]), ("serve", []), ("tui", []), ("record", ["-s", "memory-pressure", "-o", "x.jsonl"]),
    ("compare", ["-s", "memory-pressure"]), ("web", [])])
def test_a_typed_flag_reaches_the_config_and_only_typed_ones_do(command, argv):
    parser = build_parser()
    assert engine_settings(parser.parse_args([command, *argv])) == {}
    typed = ["--max-num-seqs", "3", "--max-model-len", "64", "--no-prefix-caching", "--reading-path", "--tp", "2",
             "--draft-model", "tiny-llama", "--speculative", "draft", "--num-speculative-tokens", "2"]
    settings = engine_settings(parser.parse_args([command, *typed, *argv]))
    assert settings == {"max_num_seqs": 3, "max_model_len": 64, "enable_prefix_caching": False, "path": "reading",
                        "tensor_parallel_size": 2, "draft_model": "tiny-llama", "speculative_method": "draft",
                        "num_speculative_tokens": 2}
    config = EngineConfig(**settings)
    assert (config.max_num_seqs, config.block_size) == (3, FIELDS["block_size"].default)


def test_generate_keeps_seed_for_the_request_and_gives_the_engine_its_own():
    args = build_parser().parse_args(["generate", "--seed", "7", "--engine-seed", "3", "Hi"])
    assert args.seed == 7 and engine_settings(args) == {"seed": 3}


def test_web_hands_its_engine_flags_to_every_tab():
    from nanoserve_tui.web_command import tab_command

    args = build_parser().parse_args(["web", "--block-size", "8", "--no-chunked-prefill", "--path", "torch"])
    tab = tab_command(args)
    assert build_parser().parse_args(tab[tab.index("tui"):]).block_size == 8
    assert engine_settings(build_parser().parse_args(tab[tab.index("tui"):])) == engine_settings(args)


def test_command_line_gives_the_settings_back():
    settings = {"block_size": 8, "enable_prefix_caching": False, "enforce_eager": True, "path": "reading",
                "max_num_batched_tokens": 64, "speculative_method": "ngram"}
    args = build_parser().parse_args(["tui", *command_line(settings)])
    assert engine_settings(args) == settings
