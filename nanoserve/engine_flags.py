"""The engine's command-line flags, made from EngineConfig's fields: one source for every command.

    add_engine_flags(parser)            # --block-size, --num-blocks, ... one per EngineConfig field
    config = EngineConfig(**engine_settings(args))

Every command that builds an engine (`generate`, `serve`, `tui`, `record`,
`compare`, `web`) calls `add_engine_flags` and adds only its own options. A
flag's dest is its field's name and its default the dataclass's, read from
`dataclasses.fields(EngineConfig)`; `FLAGS` below holds only what the fields
cannot say: a line of help, and a spelling where an older one is kept
(`--max-batched-tokens`, `--speculative`, `--reading-path`). A bad value is
refused by EngineConfig itself, by field, and the command line names the flag.

`engine_settings(args)` returns the settings the command line gave, and only
those: a scenario's own settings (`record`, `tui`, `compare`) give way to a
flag that was typed, and to nothing else. tests/test_engine_flags.py checks
that every field has its flag in every command, with the dataclass's default.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NamedTuple

from nanoserve.config import PATHS, EngineConfig
from nanoserve.models.resolve import ACCEPTED


class Flag(NamedTuple):
    help: str
    names: tuple[str, ...] = ()          # the spellings, when not just --field-name (the first names errors)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


FLAGS = {
    "model": Flag(f"model to run: {ACCEPTED}", ("--model", "-m")),
    "dtype": Flag("weights and KV cache", choices=("float32", "bfloat16", "float16")),
    "device": Flag("cpu, cuda or cuda:N"),
    "block_size": Flag("tokens per KV block", metavar="N"),
    "num_blocks": Flag("KV blocks in the pool (default: as many as --kv-cache-memory-mb holds)", metavar="N"),
    "kv_cache_memory_mb": Flag("KV budget in MB, used when --num-blocks is not given", metavar="MB"),
    "max_num_seqs": Flag("at most this many requests run in one step", metavar="N"),
    "max_num_batched_tokens": Flag("token budget of one step (decodes + prefill chunks)",
                                   ("--max-batched-tokens", "--max-num-batched-tokens"), metavar="N"),
    "max_model_len": Flag("prompt + output limit (default: the model's, capped by the pool and budget)",
                          metavar="N"),
    "enable_chunked_prefill": Flag("turn chunked prefill off: a prompt runs in one step", ("--no-chunked-prefill",)),
    "enable_prefix_caching": Flag("turn the radix prefix cache off", ("--no-prefix-caching",)),
    "kv_window_freeing": Flag("keep every token's KV in sliding-window layers (one block table for all layers)",
                              ("--no-kv-window-freeing",)),
    "preemption_mode": Flag("what happens to a preempted request's KV", choices=("recompute", "swap")),
    "preemption_policy": Flag("which request is preempted first", choices=("newest", "priority", "shortest_remaining")),
    "num_cpu_blocks": Flag("swap space in blocks (default: as many as --num-blocks when swapping)", metavar="N"),
    "path": Flag("which code computes a step: fast (on a CPU nanoserve/cpu/ with its C files), torch (the same "
                 "without C files) or reading (models/ and kernels/reference.py only); the same tokens",
                 choices=PATHS),
    "attention_backend": Flag("torch, triton, cpu (the C kernel) or auto (implementation.py chooses)",
                              choices=("auto", "torch", "triton", "cpu")),
    "enforce_eager": Flag("no CUDA graphs for pure-decode steps"),
    "seed": Flag("seeds random weights of tiny models and unseeded requests"),
    "speculative_method": Flag("speculative decoding: n-gram prompt lookup, or a draft model (default: off)",
                               ("--speculative",), choices=("ngram", "draft")),
    "num_speculative_tokens": Flag("tokens drafted per step with --speculative", ("--num-speculative-tokens", "-k"),
                                   metavar="K"),
    "ngram_min": Flag("shortest suffix the n-gram proposer looks up", metavar="N"),
    "ngram_max": Flag("longest suffix it tries first", metavar="N"),
    "draft_model": Flag("draft model for --speculative draft (default: the target's first --draft-layers layers)"),
    "draft_num_layers": Flag("layers of the truncated draft", ("--draft-layers",), metavar="N"),
    "tensor_parallel_size": Flag("split the model over N processes (gloo; it must divide the heads)",
                                 ("--tensor-parallel-size", "--tp"), metavar="N"),
}
GIVEN = "engine_flags_given"   # the Namespace attribute: {field: dest} of the flags the command line gave


class Setting(argparse.Action):
    """Stores a flag's value at its dest and notes that the command line gave this EngineConfig `field`."""

    def __init__(self, *args, field: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.field = field

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, {}) | {self.field: self.dest})


def add_engine_flags(parser, own: tuple[str, ...] = (), renamed: dict[str, str] | None = None) -> None:
    """A flag for every EngineConfig field on `parser` (a parser or an argument group), except the fields in
    `own`, which the command defines itself (e.g. `tui`'s --model, whose absence means a replay); `renamed`
    gives a field another flag and dest in one command (`generate`'s --seed is a request's: {"seed":
    "engine_seed"} makes the engine's --engine-seed)."""
    for field in dataclasses.fields(EngineConfig):
        if field.name in own:
            continue
        flag, dest = FLAGS[field.name], (renamed or {}).get(field.name, field.name)
        spellings = flag.names if dest == field.name and flag.names else ("--" + dest.replace("_", "-"),)
        common = dict(dest=dest, action=Setting, field=field.name, default=field.default)
        if field.name == "path":   # the older spelling, kept (first, so that an error names --path)
            parser.add_argument("--reading-path", nargs=0, const="reading", help="the same as --path reading",
                                **common)
        if field.type.startswith("bool"):   # on by default: the flag turns it off; else (False, None) on
            parser.add_argument(*spellings, nargs=0, const=field.default is not True, help=flag.help, **common)
        else:
            kind = {"int": int, "float": float}.get(field.type.split(" |")[0], str)
            shown = "" if field.default is None else " (default: %(default)s)"
            parser.add_argument(*spellings, type=kind, choices=flag.choices, metavar=flag.metavar,
                                help=flag.help + shown, **common)


def engine_settings(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the command line set, by name (none: the dataclass's, or a scenario's, hold)."""
    return {field: getattr(args, dest) for field, dest in sorted(getattr(args, GIVEN, {}).items())}


def command_line(settings: dict) -> list[str]:
    """The flags that give `settings` again (`web` hands its engine flags to every tab's `tui`)."""
    types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    words = []
    for name, value in settings.items():
        flag = (FLAGS[name].names or ("--" + name.replace("_", "-"),))[0]
        if not types[name].startswith("bool"):
            words += [flag, str(value)]
        elif value is not EngineConfig.__dataclass_fields__[name].default:   # a bool flag flips its default
            words.append(flag)
    return words
