"""Settings a what-if changes: `--set key=value` parsed and checked against `EngineConfig`.

    parse_sets(["preemption_mode=swap", "block_size=8"])
    # {'preemption_mode': 'swap', 'block_size': 8}

A value is read by its field's type (`int`, `float`, `bool`: true/false/on/off,
`None` where the field allows it, text otherwise), then the `EngineConfig`
it makes checks it. Any refusal is one `FieldError` whose field is `set`, so
the command line prints `--set block_sise=8: block_sise is not an engine
setting; ...` and exits 2.

`BRANCH_SETTINGS` lists the settings a class changes to ask "what if" (the
TUI's branch dialog offers them): preemption, the prefix cache, block size,
token budget, seats, speculative decoding and the pool size.
"""

from __future__ import annotations

import dataclasses

from nanoserve.config import OLD_NAMES, EngineConfig, current_names
from nanoserve.errors import FieldError

BRANCH_SETTINGS = ("preemption_mode", "preemption_policy", "enable_prefix_caching", "block_size",
                   "max_num_batched_tokens", "max_num_seqs", "speculative_method", "num_speculative_tokens",
                   "num_blocks")
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def field_types() -> dict[str, str]:
    """EngineConfig field -> its annotation as written, e.g. {"num_blocks": "int | None", ...}; the older
    names of `path` (fast_paths, c_kernels: booleans) are read too."""
    return {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)} | dict.fromkeys(OLD_NAMES, "bool")


def parse_value(name: str, text: str):
    """`text` read as a value of EngineConfig field `name` (ValueError with the reason)."""
    kind = field_types()[name]
    if "None" in kind and text.lower() in ("none", "null", "off") and "bool" not in kind:
        return None
    if kind.startswith("bool"):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"is not a boolean (true/false, on/off): {text!r}")
    if kind.startswith("int"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"is not a whole number: {text!r}") from None
    if kind.startswith("float"):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"is not a number: {text!r}") from None
    return text


def parse_sets(items: list[str]) -> dict:
    """`["key=value", ...]` -> {field: value}; FieldError("set", ...) names the bad item."""
    types, changes = field_types(), {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise FieldError("set", f"{item!r} is not key=value (e.g. --set preemption_mode=swap)")
        if key not in types:
            raise FieldError("set", f"{item}: {key} is not an engine setting; settings are: "
                                    f"{', '.join(t for t in types if t not in OLD_NAMES)}")
        try:
            changes[key] = parse_value(key, text.strip())
        except ValueError as exc:
            raise FieldError("set", f"{item}: {key} {exc}") from None
    return current_names(changes)


def checked_config(base: dict, changes: dict) -> EngineConfig:
    """EngineConfig(**base, **changes); a bad value in `changes` is reported as the --set item it came from."""
    try:
        return EngineConfig(**{**base, **changes})
    except FieldError as exc:
        if exc.field in changes:
            raise FieldError("set", f"{exc.field}={changes[exc.field]}: {exc}") from None
        raise
