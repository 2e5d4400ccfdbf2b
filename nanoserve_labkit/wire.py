"""The lab channel's wire format: length-prefixed JSON frames, and the values they may carry.

The checker (the parent) and the worker that holds a student's code talk over
two pipes. Nothing on them is ever unpickled: a frame is a 4-byte length and a
JSON object, and a value is plain JSON (None, bools, ints, floats, strings)
or a tagged object `{"T": tag, ...}` that `remote.py` builds and reads:

    tuple, fset, bytes, slice      immutable values, element by element
    list, dict, set, deque         a container *copied* (a call's result or argument)
    tensor                         dtype, shape and the bytes (CPU tensors only)
    gen                            a torch.Generator's state (the caller's generator follows it)
    dtype, device                  by name
    enum                           a member of an enum defined in nanoserve, by class and name
    event                          an event of nanoserve.events, field by field
    exc                            an exception: type name, message, where it was raised
    ref / meth / home              an object left where it lives: a handle to it (see remote.py)

This module owns the framing and the tensor/generator/bytes codecs; which
object gets which tag, and what a handle may do, is `remote.py`'s business.
"""

from __future__ import annotations

import base64
import json
import os
import select
import struct
import time

MAX_FRAME = 64 << 20       # bytes: a frame larger than this is a broken channel, not a message
_HEADER = struct.Struct("!I")


class ChannelBroken(BaseException):
    """The other side closed the channel or sent something that is not a frame (it died, or wrote to it).

    A BaseException, like KeyboardInterrupt: it must pass through the engine's `except Exception`."""


class Deadline(BaseException):
    """The other side did not answer within the time it was given."""


def send(fd: int, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"a {len(data)}-byte message is over the channel's {MAX_FRAME}-byte limit")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        try:
            n = os.write(fd, view)
        except (BrokenPipeError, OSError) as exc:
            raise ChannelBroken(f"the other side closed the channel ({exc.__class__.__name__})") from None
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise Deadline()
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except OSError as exc:
            raise ChannelBroken(f"reading the channel failed ({exc.__class__.__name__})") from None
        if not chunk:
            raise ChannelBroken("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd: int, deadline: float | None = None) -> dict:
    """The next frame as a dict; Deadline at `deadline` (time.monotonic()), ChannelBroken on garbage or EOF."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if size > MAX_FRAME:
        raise ChannelBroken(f"a frame of {size} bytes announced: not the lab's protocol")
    try:
        message = json.loads(_read_exact(fd, size, deadline))
    except (ValueError, UnicodeDecodeError):
        raise ChannelBroken("a frame that is not JSON: not the lab's protocol") from None
    if not isinstance(message, dict):
        raise ChannelBroken("a frame that is not a JSON object: not the lab's protocol")
    return message


# -- codecs for the few binary values -----------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ValueError("expected base64 text")
    return base64.b64decode(text.encode("ascii"), validate=True)


def tensor_to_wire(t) -> dict:
    import torch
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach().contiguous()
    raw = t.view(torch.uint8) if t.numel() and t.dtype != torch.bool else t.to(torch.uint8)
    return {"T": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": b64(raw.numpy().tobytes() if t.numel() else b"")}


def tensor_from_wire(obj: dict):
    import torch
    dtype = getattr(torch, str(obj.get("dtype")), None)
    shape = obj.get("shape")
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or \
            not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError("a tensor with a bad dtype or shape")
    data = bytearray(unb64(obj.get("data")))
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        if len(data) != numel:
            raise ValueError("a bool tensor whose bytes do not match its shape")
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.bool).reshape(shape) if numel \
            else torch.zeros(shape, dtype=torch.bool)
    if len(data) != numel * torch.empty((), dtype=dtype).element_size():
        raise ValueError("a tensor whose bytes do not match its shape")
    return torch.frombuffer(data, dtype=dtype).reshape(shape).clone() if numel else torch.zeros(shape, dtype=dtype)


def generator_to_wire(g) -> dict:
    return {"T": "gen", "state": b64(g.get_state().numpy().tobytes())}


def generator_from_wire(obj: dict):
    import torch
    g = torch.Generator()
    state = torch.frombuffer(bytearray(unb64(obj.get("state"))), dtype=torch.uint8).clone()
    try:
        g.set_state(state)
    except RuntimeError as exc:
        raise ValueError(f"a generator state that torch refuses ({exc})") from None
    return g


def special(v, copy_generator: bool = True):
    """Tensors, generators, dtypes and devices, without importing torch when it is not loaded."""
    module = type(v).__module__
    if not module.startswith("torch"):
        return None
    import torch
    if isinstance(v, torch.Tensor):
        return tensor_to_wire(v)
    if isinstance(v, torch.Generator):
        return generator_to_wire(v) if copy_generator else None
    if isinstance(v, torch.dtype):
        return {"T": "dtype", "v": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"T": "device", "v": str(v)}
    return None


def snapshot(v):
    """What an argument was before a call, for the ones a callee may change in place (tensors, generators)."""
    module = type(v).__module__
    if not module.startswith("torch"):
        return None
    import torch
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, torch.Generator):
        return v.get_state()
    return None


def changed(before, now) -> bool:
    import torch
    if isinstance(now, torch.Generator):
        return not torch.equal(before, now.get_state())
    return before.shape != now.shape or not torch.equal(before, now)


def copy_back(original, new) -> None:
    """The callee changed a tensor (or advanced a generator) it was given a copy of: change ours the same way."""
    import torch
    if isinstance(original, torch.Tensor) and isinstance(new, torch.Tensor):
        if original.shape != new.shape:
            raise ValueError(f"the call changed a tensor's shape in place ({tuple(original.shape)} -> "
                             f"{tuple(new.shape)})")
        original.copy_(new.to(original.dtype))
    elif isinstance(original, torch.Generator) and isinstance(new, torch.Generator):
        original.set_state(new.get_state())
