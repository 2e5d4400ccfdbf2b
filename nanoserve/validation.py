"""Typed checks for settings and request inputs; each failure is a `FieldError` naming the field.

`EngineConfig` and `SamplingParams` check their fields here in `__post_init__`,
and the engine checks a request's prompt and ids here before it changes
anything. A check returns the value in its plain Python type (a numpy or
torch integer becomes an `int`), so the rest of the engine only ever sees
ints, floats, bools and strings:

    >>> integer("max_tokens", 2.5, minimum=1)
    Traceback (most recent call last):
    FieldError: max_tokens must be an int, got 2.5 (float)

`True` is an int to Python but never a count here, and NaN or infinity is a
float but never a setting: both are refused. Text must be valid Unicode
(`well_formed`: no lone surrogates), checked at every edge where text comes
in: `add_request`, the command line and the HTTP API. `available_memory` tells the
config how much memory the machine has before a pool is allocated.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable

from nanoserve.errors import FieldError


def _kind(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def integer(field: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (not a bool, not a float with no fraction) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldError(field, f"must be an int, got {_kind(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise FieldError(field, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FieldError(field, f"must be at most {maximum}, got {value}")
    return value


def optional_integer(field: str, value, minimum: int | None = None, maximum: int | None = None) -> int | None:
    return None if value is None else integer(field, value, minimum, maximum)


def number(field: str, value) -> float:
    """A finite real number (an int is fine; a bool, NaN or infinity is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(field, f"must be a number, got {_kind(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise FieldError(field, f"must be a finite number, got {value}")
    return value


def boolean(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"must be True or False, got {_kind(value)}")
    return value


def choice(field: str, value, options: Iterable) -> object:
    """One of `options` (strings, maybe None), compared by equality after a type check."""
    options = tuple(options)
    if value not in options or (value is not None and not isinstance(value, str)):
        names = ", ".join(repr(o) for o in options)
        raise FieldError(field, f"must be one of {names}, got {value!r}")
    return value


def text(field: str, value, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise FieldError(field, f"must be a str, got {_kind(value)}")
    if not value and not empty_ok:
        raise FieldError(field, "must not be empty")
    return well_formed(field, value)


def well_formed(field: str, value: str) -> str:
    """`value` if it is valid Unicode text, that is, it encodes to UTF-8.

    A Python str can hold a lone UTF-16 surrogate (U+D800..U+DFFF) that no text encoding
    accepts: JSON's "\\ud800" parses to one, and so does a command-line argument with a byte
    that is not UTF-8 (Python keeps it as U+DC80..U+DCFF). The tokenizer, a JSONL trace and an
    HTTP response all need UTF-8, so such a string is refused where it comes in. The message
    names the code point, never the character itself (it could not be printed either).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        byte = f" (the byte 0x{code - 0xDC00:02x}, which is not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
        raise FieldError(field, f"is not valid Unicode text: a lone surrogate U+{code:04X}{byte} at "
                                f"character {exc.start}") from None
    return value


def token_ids(field: str, value, vocab_size: int | None = None) -> list[int]:
    """A list of token ids: ints in [0, vocab_size). A str or bytes is text, not token ids."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):   # a torch tensor or numpy array
        value = value.tolist()
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Iterable):
        raise FieldError(field, f"must be a list of token ids (ints), got {_kind(value)}")
    ids = list(value)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise FieldError(field, f"must hold only ints (token ids), got {_kind(bad[0])}")
    ids = [int(t) for t in ids]
    outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
        raise FieldError(field, f"has token ids {outside[:5]} outside the vocabulary {bound}")
    return ids


def available_memory(device: str) -> int | None:
    """Bytes the machine can still give on `device` (None when it cannot tell)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        import psutil  # optional: the most portable answer
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
