"""What crosses the lab's channel, and how: `Codec`, the half of an endpoint that turns values into the
wire's tagged JSON (`wire.py`) and back, with the handles that stand for objects left where they live.

Values are copied (numbers, strings, tuples, tensors, a generator's state, enum members and events of
nanoserve, exceptions with the frames they came through); a list, dict, set or deque is shared when it
is an attribute and copied when it is a call's argument or result; any other object gets a handle.

On the parent's side (`strict`) the worker's values are checked as they are decoded, and what the parent
hands the worker when the worker asks is guarded: only objects of the allowed engine types (and plain
containers) get a handle, never a module, class or function of the checker.
"""

from __future__ import annotations

import collections
import enum
import importlib
import traceback
from dataclasses import fields, is_dataclass

from nanoserve_labkit import wire
from nanoserve_labkit.proxy import CONTAINERS, Proxy, RemoteMethod
from nanoserve_labkit.wire import ChannelBroken

MAX_ITEMS = 1_000_000     # iterating a remote container (or generator) stops being an answer here
# The parent's objects a worker may get a handle to when it reads an attribute or gets a call's result.
ALLOWED = {
    "nanoserve.block_pool": {"BlockPool", "Block", "FreeBlockQueue"},
    "nanoserve.radix_cache": {"RadixCache", "RadixNode"},
    "nanoserve.kv_manager": {"KVManager", "BlockMoves"},
    "nanoserve.scheduler": {"Scheduler", "StepPlan", "ScheduledChunk", "Planning"},
    "nanoserve.sequence": {"Sequence"},
    "nanoserve.sampling_params": {"SamplingParams"},
    "nanoserve.config": {"EngineConfig"},
    "nanoserve.events": {"StepClock"},
    "nanoserve.request": {"Request"},                       # the step-commit lab: the request table's rows
    "nanoserve.intake": {"PreparedRequest"},
    "nanoserve.detokenizer": {"IncrementalDetokenizer"},
    "nanoserve.outputs": {"RequestOutput", "CompletionOutput", "RequestMetrics"},
    "nanoserve.sampler": {"SampledToken"},
    "nanoserve.structured_output": {"SequenceGrammar", "MaskInfo"},
    "nanoserve.labs.commit_setup": {"Letters", "Grammar", "Proposer"},
}
SAFE_ERRORS = {e.__name__: e for e in (
    ValueError, IndexError, KeyError, TypeError, AttributeError, MemoryError, NotImplementedError, RuntimeError,
    ZeroDivisionError, AssertionError, OverflowError, LookupError, ArithmeticError, RecursionError, NameError,
    UnboundLocalError, EOFError, OSError, FileNotFoundError, PermissionError, ImportError, ModuleNotFoundError,
    UnicodeError, BufferError, FloatingPointError)}


class RemoteError(Exception):
    """An exception of a type the parent does not rebuild (SystemExit, a student's own class): named as sent."""


_remote_error_types: dict[tuple[str, type], type] = {}


def _error_type(name: str, base: type = RemoteError) -> type:
    """A stand-in class named `name`: a subclass of the nearest builtin base it had (a student's
    `class PoolFull(MemoryError)` still passes `except MemoryError`), else of RemoteError."""
    if (name, base) not in _remote_error_types:
        _remote_error_types[name, base] = type(name, (base,), {"remote": True})
    return _remote_error_types[name, base]


class Refused(AttributeError):
    """The parent does not hand this to the student's code (a private name, a module, a class...)."""


class Codec:
    """Encoding and decoding for an endpoint: its exports (handle -> object) and proxies of the other side."""

    strict: bool
    exports: dict
    handles: dict
    proxies: dict
    method_names: set
    withheld_types: frozenset

    def export(self, obj) -> int:
        key = id(obj)
        if key not in self.handles:
            self.handles[key] = self._next_handle
            self.exports[self._next_handle] = obj
            self._next_handle += 1
        return self.handles[key]

    def encode(self, v, by_value: bool | str = False, guard: bool = False, argument: bool = False):
        """`v` for the wire. by_value: containers copied (one level; "deep": all levels), else shared.

        guard (the parent answering the worker): only allowed objects get a handle (see ALLOWED); what
        the parent passes in its own requests is its code's choice and goes as it is. A torch.Generator
        is copied (and its new state copied back) when it is a call's `argument` or comes from the
        parent; one the worker hands over stays there (a handle: the checks draw from it there)."""
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if isinstance(v, enum.Enum):
            if t.__module__.startswith("nanoserve."):
                return {"T": "enum", "c": f"{t.__module__}:{t.__qualname__}", "n": v.name}
        elif isinstance(v, bool):
            return bool(v)
        elif isinstance(v, int):
            return int(v)
        elif isinstance(v, float):
            return float(v)
        elif isinstance(v, str):
            return str(v)
        if isinstance(v, Proxy) and v._rpc_ep is self:
            return {"T": "home", "h": v._rpc_h}
        if isinstance(v, RemoteMethod) and v.target._rpc_ep is self:
            return {"T": "homem", "h": v.target._rpc_h, "n": v.name}
        inner = "deep" if by_value == "deep" else False
        if t is tuple or isinstance(v, tuple):
            return {"T": "tuple", "v": [self.encode(x, inner, guard) for x in v]}
        if t is frozenset:
            return {"T": "fset", "v": [self.encode(x, inner, guard) for x in v]}
        if t in (bytes, bytearray):
            return {"T": "bytes", "v": wire.b64(bytes(v))}
        if t is slice:
            return {"T": "slice", "v": [self.encode(x) for x in (v.start, v.stop, v.step)]}
        if t in CONTAINERS and by_value:
            kind = CONTAINERS[t]
            if kind == "dict":
                return {"T": "dict", "v": [[self.encode(k, inner, guard), self.encode(x, inner, guard)]
                                           for k, x in v.items()]}
            return {"T": kind, "v": [self.encode(x, inner, guard) for x in v]}
        if t.__name__ in ("dict_keys", "dict_values", "dict_items", "generator", "map", "filter", "zip",
                          "enumerate", "reversed", "list_iterator") and by_value:
            return {"T": "list", "v": [self.encode(x, inner, guard) for x in take(v)]}
        special = wire.special(v, argument or self.strict)
        if special is not None:
            return special
        if _is_event(v):
            return {"T": "event", "c": t.__name__, "f": {f.name: self.encode(getattr(v, f.name), "deep", guard)
                                                        for f in fields(v)}}
        if _is_bound_method(v) and not v.__name__.startswith("_") and (not self.strict or self._may_share(v.__self__)):
            return {"T": "meth", "s": self.encode(v.__self__, False, guard), "n": v.__name__}
        if guard and not self._may_share(v):
            raise Refused(f"the lab does not give your code a {t.__name__} (only the engine parts it was given)")
        kind = CONTAINERS.get(t) or ("module" if t.__name__ == "module" else "class" if isinstance(v, type)
                                     else "callable" if callable(v) else "obj")
        return {"T": "ref", "h": self.export(v), "k": kind, "t": f"{t.__module__}:{t.__qualname__}"}

    def _may_share(self, v) -> bool:
        """Whether the worker may get a handle to `v`: one the parent handed over, or an allowed engine type
        that is not the class the student is writing (the engine's own would answer for them)."""
        t = type(v)
        withheld = (t.__module__, t.__qualname__) in self.withheld_types
        return id(v) in self.handles or (allowed_type(v) and not withheld)

    def decode(self, v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            raise ChannelBroken("a bare JSON list on the channel: not the lab's protocol")
        if not isinstance(v, dict):
            raise ChannelBroken("a value that is not the lab's protocol")
        tag = v.get("T")
        try:
            if tag == "ref":
                return self._proxy(v)
            if tag == "home":
                return self._home(v.get("h"))
            if tag == "homem" or tag == "meth":
                target = self._home(v.get("h")) if tag == "homem" else self.decode(v.get("s"))
                name = v.get("n")
                if not isinstance(name, str) or (self.strict and name.startswith("_")):
                    raise ChannelBroken("a method that may not be named")
                if isinstance(target, Proxy):
                    self.method_names.add((target._rpc_type, name))
                    return RemoteMethod(target, name)
                return getattr(target, name)
            if tag in ("tuple", "list", "set", "deque", "fset"):
                items = [self.decode(x) for x in as_list(v.get("v"))]
                return {"tuple": tuple, "list": list, "set": set, "deque": collections.deque,
                        "fset": frozenset}[tag](items)
            if tag == "dict":
                return {self.decode(k): self.decode(x) for k, x in (_pair(p) for p in as_list(v.get("v")))}
            if tag == "bytes":
                return wire.unb64(v.get("v"))
            if tag == "slice":
                return slice(*[self.decode(x) for x in as_list(v.get("v"))][:3])
            if tag == "tensor":
                return wire.tensor_from_wire(v)
            if tag == "gen":
                return wire.generator_from_wire(v)
            if tag == "dtype":
                import torch
                dtype = getattr(torch, str(v.get("v")), None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError("not a dtype")
                return dtype
            if tag == "device":
                import torch
                return torch.device(str(v.get("v")))
            if tag == "enum":
                return _enum(v)
            if tag == "event":
                return _event(self, v)
            if tag == "exc":
                return self.decode_error(v)
        except (ValueError, TypeError, KeyError, AttributeError, ImportError) as exc:
            raise ChannelBroken(f"a {tag} value that does not decode ({exc}): not the lab's protocol") from None
        raise ChannelBroken(f"an unknown value tag {tag!r}: not the lab's protocol")

    def _home(self, handle):
        if handle not in self.exports:
            raise ChannelBroken("a handle that was never handed over")
        return self.exports[handle]

    def _proxy(self, v: dict) -> Proxy:
        handle, kind, type_name = v.get("h"), v.get("k"), v.get("t")
        if not isinstance(handle, int) or not isinstance(kind, str) or not isinstance(type_name, str):
            raise ChannelBroken("a malformed handle")
        if handle not in self.proxies:
            self.proxies[handle] = Proxy(self, handle, kind, type_name)
        return self.proxies[handle]

    def local_type(self, type_name: str):
        """The class a proxy of `type_name` passes isinstance() as: a builtin container, or an engine class
        of the allow list (the worker's view of the parent's objects)."""
        module, _, qual = type_name.partition(":")
        if module == "builtins" and qual in ("list", "dict", "set"):
            return {"list": list, "dict": dict, "set": set}[qual]
        if module == "collections" and qual == "deque":
            return collections.deque
        if not self.strict and qual in ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), qual, None)
        return None

    # -- errors -----------------------------------------------------------------------------------

    def encode_error(self, exc: BaseException, depth: int = 0) -> dict:
        frames = [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_tb(exc.__traceback__)]
        frames += [list(f) for f in getattr(exc, "lab_frames", ())]      # (it came from the other side: deeper)
        cause = exc.__cause__ or exc.__context__
        return {"T": "exc", "type": type(exc).__name__, "mod": type(exc).__module__,
                "bases": [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"][:8],
                "msg": str(exc)[:4000], "frames": frames[-40:],
                "hint": getattr(exc, "hint", None) if isinstance(getattr(exc, "hint", None), str) else None,
                "cause": self.encode_error(cause, depth + 1) if cause is not None and cause is not exc and
                depth < 4 else None}

    def decode_error(self, v) -> BaseException:
        if not isinstance(v, dict) or not isinstance(v.get("type"), str) or not v["type"].isidentifier():
            raise ChannelBroken("a malformed exception: not the lab's protocol")
        name, module, msg = v["type"], v.get("mod"), str(v.get("msg", ""))
        cls = SAFE_ERRORS.get(name) if module == "builtins" else None
        if cls is None and not self.strict and isinstance(module, str) and module.startswith("nanoserve."):
            found = getattr(importlib.import_module(module), name, None)   # the worker trusts the parent
            cls = found if isinstance(found, type) and issubclass(found, Exception) else None
        if cls is None:
            bases = v.get("bases") if isinstance(v.get("bases"), list) else []
            base = next((SAFE_ERRORS[b] for b in bases if isinstance(b, str) and b in SAFE_ERRORS), RemoteError)
            cls = _error_type(name, base)
        exc = cls.__new__(cls)
        Exception.__init__(exc, msg) if issubclass(cls, Exception) else BaseException.__init__(exc, msg)
        if cls is KeyError and msg.startswith("'") and msg.endswith("'"):
            exc.args = (msg[1:-1],)
        frames = v.get("frames") if isinstance(v.get("frames"), list) else []
        exc.lab_frames = [f for f in frames if isinstance(f, list) and len(f) == 4
                          and isinstance(f[0], str) and isinstance(f[1], int)]
        if not self.strict and isinstance(v.get("hint"), str):
            exc.hint = v["hint"]
        if isinstance(v.get("cause"), dict):          # what it was raised from (the student's own raise, often)
            exc.__cause__ = self.decode_error(v["cause"])
        return exc



def as_list(v) -> list:
    if not isinstance(v, list):
        raise ChannelBroken("a list was expected: not the lab's protocol")
    return v


def as_dict(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ChannelBroken("a dict was expected: not the lab's protocol")
    return v


def _pair(p):
    if not isinstance(p, list) or len(p) != 2:
        raise ChannelBroken("a dict entry was expected: not the lab's protocol")
    return p


def take(obj) -> list:
    out = []
    for item in obj:
        out.append(item)
        if len(out) > MAX_ITEMS:
            raise OverflowError(f"more than {MAX_ITEMS} items: an iteration that does not end?")
    return out


def allowed_type(v) -> bool:
    t = type(v)
    return t in CONTAINERS or t.__qualname__ in ALLOWED.get(t.__module__, ())


def _is_bound_method(v) -> bool:
    return type(v).__name__ in ("method", "builtin_function_or_method", "method-wrapper") and \
        getattr(v, "__self__", None) is not None and type(v.__self__).__name__ != "module"


def _is_event(v) -> bool:
    from nanoserve import events as ev
    return is_dataclass(v) and isinstance(v, ev.Event)


def _event(ep: Codec, v: dict):
    from nanoserve import events as ev
    cls = getattr(ev, str(v.get("c")), None)
    if not (isinstance(cls, type) and issubclass(cls, ev.Event) and is_dataclass(cls)):
        raise ValueError("not an event of nanoserve.events")
    values = {str(k): ep.decode(x) for k, x in as_dict(v.get("f")).items()}
    return cls(**values)


def _enum(v: dict):
    module, _, qual = str(v.get("c")).partition(":")
    if not module.startswith("nanoserve."):
        raise ValueError("an enum from outside nanoserve")
    cls = getattr(importlib.import_module(module), qual, None)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise ValueError("not an enum")
    return cls[str(v.get("n"))]
