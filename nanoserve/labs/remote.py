"""Objects that live in another process, used as if they were here: the lab's two-way channel.

A lab check runs in the parent (the checker); the student's code runs in a
worker (`worker.py`). The engine the checks build lives in the parent, and the
student's part of it is a `Proxy`: using it (`pool.allocate(2)`,
`len(pool.free_queue)`, `pool.blocks[3].ref_count`) sends one request to the
worker, which does it to the real object and answers with a value. While the
worker's code runs, it may use the parent's objects the same way (the
student's scheduler calls `self.kv.grow(seq, 4)` on the engine's KV manager):
requests nest, on one channel, in call order.

What crosses, and how (the wire format is `wire.py`):

* values are copied: numbers, strings, tuples, tensors (a tensor argument the
  callee changed in place is copied back into the caller's), a
  torch.Generator's state (so the caller's generator advances), enum members
  and events of nanoserve, exceptions (type, message, the frames they came
  through, so a row can name the student's file and line);
* a list, dict, set or deque is *shared* when it is an attribute
  (`seq.block_table.append(7)` changes the engine's table) and *copied* when
  it is a call's argument or result;
* any other object stays where it is and the other side gets a handle to it.

The worker is not trusted. The parent decodes only JSON (never a pickle), and
answers a worker's request only on objects it handed over, by public names,
with results of an allowed type (the engine's data structures and plain
containers; never a module, class or function), so the student's code can
change the engine parts it was given, as a component does, and nothing else
in the checker. The verdict is the parent's: the worker only answers calls.
"""

from __future__ import annotations

import collections
import enum
import importlib
import json
import time
import traceback
from dataclasses import fields, is_dataclass

from nanoserve.labs import wire
from nanoserve.labs.wire import ChannelBroken, Deadline

MAX_ITEMS = 1_000_000     # iterating a remote container (or generator) stops being an answer here
CONTAINERS = {list: "list", dict: "dict", set: "set", collections.deque: "deque",
              collections.Counter: "dict", collections.defaultdict: "dict", collections.OrderedDict: "dict"}
# The parent's objects a worker may get a handle to when it reads an attribute or gets a call's result.
ALLOWED = {
    "nanoserve.block_pool": {"BlockPool", "Block", "FreeBlockQueue"},
    "nanoserve.radix_cache": {"RadixCache", "RadixNode"},
    "nanoserve.kv_manager": {"KVManager", "BlockMoves"},
    "nanoserve.scheduler": {"Scheduler", "SchedulerOutput", "ScheduledChunk", "StepPlan"},
    "nanoserve.sequence": {"Sequence"},
    "nanoserve.sampling_params": {"SamplingParams"},
    "nanoserve.config": {"EngineConfig"},
    "nanoserve.events": {"StepClock"},
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


class Proxy:
    """An object on the other side of the channel. Attribute access, calls and the container protocol
    are requests; `==` on a list/dict/set/deque compares copies; other objects are equal only to themselves."""

    __slots__ = ("_rpc_ep", "_rpc_h", "_rpc_kind", "_rpc_type", "__weakref__")

    def __init__(self, ep: Endpoint, handle: int, kind: str, type_name: str) -> None:
        object.__setattr__(self, "_rpc_ep", ep)
        object.__setattr__(self, "_rpc_h", handle)
        object.__setattr__(self, "_rpc_kind", kind)
        object.__setattr__(self, "_rpc_type", type_name)

    def _rpc(self, op: str, **kw):
        return self._rpc_ep.request({"op": op, "h": self._rpc_h, **kw})

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if (self._rpc_type, name) in self._rpc_ep.method_names:
            return RemoteMethod(self, name)
        return self._rpc("getattr", n=name)

    def __setattr__(self, name: str, value) -> None:
        self._rpc("setattr", n=name, v=self._rpc_ep.encode(value, by_value=True))

    def __call__(self, *args, **kwargs):
        return self._rpc_ep.call({"op": "call", "h": self._rpc_h}, args, kwargs)

    def __getitem__(self, key):
        return self._rpc("getitem", i=self._rpc_ep.encode(key, by_value=True))

    def __setitem__(self, key, value) -> None:
        self._rpc("setitem", i=self._rpc_ep.encode(key, by_value=True), v=self._rpc_ep.encode(value, by_value=True))

    def __delitem__(self, key) -> None:
        self._rpc("delitem", i=self._rpc_ep.encode(key, by_value=True))

    def __len__(self) -> int:
        n = self._rpc("len")
        if not isinstance(n, int) or n < 0:
            raise TypeError("a remote len() that is not a count")
        return n

    def __bool__(self) -> bool:
        return bool(self._rpc("bool") is True)

    def __iter__(self):
        items = self._rpc("iter")
        if not isinstance(items, list):
            raise TypeError("a remote iteration that is not a sequence")
        return iter(items)

    def __reversed__(self):
        return reversed(list(self))

    def __contains__(self, item) -> bool:
        return self._rpc("contains", v=self._rpc_ep.encode(item, by_value=True)) is True

    def _value(self):
        """A copy of this container, here (its items' containers copied too; other objects stay handles)."""
        return self._rpc("value")

    def __eq__(self, other):
        if self._rpc_kind in CONTAINERS.values():
            mine = self._value()
            theirs = other._value() if isinstance(other, Proxy) and other._rpc_kind in CONTAINERS.values() else other
            return mine == theirs
        return self is other

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        if self._rpc_kind in CONTAINERS.values():
            raise TypeError(f"unhashable remote {self._rpc_kind}")
        return object.__hash__(self)

    def __add__(self, other):
        return self._value() + (other._value() if isinstance(other, Proxy) else other)

    def __radd__(self, other):
        return other + self._value()

    def __iadd__(self, other):
        """`shared_list += items` extends the list where it lives (as += does), and stays shared."""
        items = list(other._value() if isinstance(other, Proxy) else other)
        if self._rpc_kind in ("list", "deque"):
            RemoteMethod(self, "extend")(items)
        elif self._rpc_kind in ("set", "dict"):
            RemoteMethod(self, "update")(items)
        else:
            return NotImplemented
        return self

    def __repr__(self) -> str:
        text = self._rpc("repr")
        return text if isinstance(text, str) else f"<remote {self._rpc_type}>"

    __str__ = __repr__

    @property
    def __class__(self):
        """isinstance() sees the type it stands for when this side has it (a container, an engine class)."""
        local = self._rpc_ep.local_type(self._rpc_type)
        return local if local is not None else Proxy

    def __reduce_ex__(self, protocol):
        raise TypeError("an object of the other process cannot be pickled or copied")


class RemoteMethod:
    """`proxy.name` where name is a method: calling it is one request."""

    __slots__ = ("target", "name")

    def __init__(self, target: Proxy, name: str) -> None:
        self.target, self.name = target, name

    def __call__(self, *args, **kwargs):
        ep = self.target._rpc_ep
        return ep.call({"op": "callm", "h": self.target._rpc_h, "n": self.name}, args, kwargs)

    def __repr__(self) -> str:
        return f"<remote method {self.target._rpc_type}.{self.name}>"


class Endpoint:
    """One side of the channel: its exported objects (by handle) and its proxies of the other side's.

    `strict` (the parent): requests from the other side are checked (see the module docstring).
    `send`/`recv` move frames; a `Loopback` pair calls the peer directly instead (tests).
    """

    def __init__(self, send=None, recv=None, strict: bool = False) -> None:
        self._send, self._recv = send, recv
        self.peer: Endpoint | None = None         # set for a loopback pair
        self.strict = strict
        self.exports: dict[int, object] = {}      # handle -> object (kept alive while exported)
        self.handles: dict[int, int] = {}         # id(object) -> handle
        self.proxies: dict[int, Proxy] = {}       # the other side's handle -> our proxy
        self.method_names: set[tuple[str, str]] = set()   # (remote type, name) seen to be methods
        self._next_handle = 1
        self._next_id = 1
        self._depth = 0                           # requests of ours waiting for an answer
        self.budget_s: float | None = None        # time the other side may take in our requests (parent)
        self._started = 0.0
        self.serve_ops: dict[str, object] = {}    # extra ops this side serves ("load", "helper", ...)

    # -- requests -----------------------------------------------------------------------------

    def call(self, message: dict, args: tuple, kwargs: dict):
        message["a"] = [self.encode(a, by_value=True, argument=True) for a in args]
        message["k"] = {str(k): self.encode(v, by_value=True, argument=True) for k, v in kwargs.items()}
        return self.request(message, args, kwargs)

    def request(self, message: dict, args: tuple = (), kwargs: dict | None = None):
        message["id"] = self._next_id
        self._next_id += 1
        top = self._depth == 0
        if top:
            self._started = time.monotonic()
        self._depth += 1
        try:
            if self.peer is not None:
                reply = self.peer.serve(json.loads(json.dumps(message)))
                reply = json.loads(json.dumps(reply))
            else:
                self._send(message)
                reply = self._await(message["id"])
        finally:
            self._depth -= 1
            if top and self.budget_s is not None:
                self.budget_s -= time.monotonic() - self._started
        return self._answer(reply, args, kwargs or {})

    def _await(self, request_id: int) -> dict:
        while True:
            deadline = None if self.budget_s is None else self._started + self.budget_s
            message = self._recv(deadline)
            if "re" in message:
                if message["re"] != request_id:
                    raise ChannelBroken("an answer to a request that was not asked: not the lab's protocol")
                return message
            self._send(self.serve(message))

    def _answer(self, reply: dict, args: tuple, kwargs: dict):
        for where, value in reply.get("back") or ():
            original = args[where] if isinstance(where, int) and 0 <= where < len(args) else kwargs.get(where)
            _copy_back(original, self.decode(value))
        if "err" in reply:
            raise self.decode_error(reply["err"])
        if "ok" not in reply:
            raise ChannelBroken("an answer with neither a value nor an error: not the lab's protocol")
        return self.decode(reply["ok"])

    # -- serving the other side's requests ------------------------------------------------------

    def serve(self, message: dict) -> dict:
        request_id = message.get("id")
        try:
            value, back, by_value = self._do(message)
            reply = {"re": request_id, "ok": self.encode(value, by_value=by_value, guard=self.strict)}
            if back:
                reply["back"] = back
            return reply
        except (ChannelBroken, Deadline):
            raise
        except BaseException as exc:   # the served code raised (or exited): the requester gets the exception
            if isinstance(exc, KeyboardInterrupt) and self.strict:
                raise
            return {"re": request_id, "err": self.encode_error(exc)}

    def _target(self, message: dict):
        handle = message.get("h")
        if handle not in self.exports:
            raise ChannelBroken("a request on an object that was never handed over")
        return self.exports[handle]

    def _name(self, message: dict) -> str:
        name = message.get("n")
        if not isinstance(name, str):
            raise ChannelBroken("a request without a name")
        if self.strict and name.startswith("_"):
            raise Refused(f"the lab does not give your code the engine's private {name!r}")
        return name

    def _do(self, m: dict):
        """(value, copied-back arguments, whether the value is a copy) for one request."""
        op = m.get("op")
        if op in self.serve_ops and not self.strict:
            return self.serve_ops[op](self, m), None, True
        if op == "call" or op == "callm":
            fn = self._target(m) if op == "call" else getattr(self._target(m), self._name(m))
            args = [self.decode(a) for a in _list(m.get("a"))]
            kwargs = {str(k): self.decode(v) for k, v in _dict(m.get("k")).items()}
            snap = {i: _snapshot(a) for i, a in enumerate(args)} | {k: _snapshot(v) for k, v in kwargs.items()}
            value = fn(*args, **kwargs)
            back = []
            for where, before in snap.items():
                now = args[where] if isinstance(where, int) else kwargs[where]
                if before is not None and _changed(before, now):
                    back.append([where, self.encode(now, by_value=True, guard=self.strict)])
            return value, back, True
        target = self._target(m)
        if op == "getattr":
            return getattr(target, self._name(m)), None, False
        if op == "setattr":
            name = self._name(m)
            if self.strict and (not _allowed_type(target) or not hasattr(target, name)):
                raise Refused(f"your code may not set {name!r} on a {type(target).__name__}")
            setattr(target, name, self.decode(m.get("v")))
            return None, None, True
        if op == "getitem":
            key = self.decode(m.get("i"))
            return target[key], None, isinstance(key, slice)
        if op == "setitem":
            target[self.decode(m.get("i"))] = self.decode(m.get("v"))
            return None, None, True
        if op == "delitem":
            del target[self.decode(m.get("i"))]
            return None, None, True
        if op == "len":
            return len(target), None, True
        if op == "bool":
            return bool(target), None, True
        if op == "contains":
            return self.decode(m.get("v")) in target, None, True
        if op == "iter":
            return _take(target), None, True        # the items themselves are shared
        if op == "value":
            return target, None, "deep"
        if op == "repr":
            return repr(target)[:10_000], None, True
        raise ChannelBroken(f"an unknown request {op!r}: not the lab's protocol")

    # -- values ----------------------------------------------------------------------------------

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
            return {"T": "list", "v": [self.encode(x, inner, guard) for x in _take(v)]}
        special = _special(v, argument or self.strict)
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
        return id(v) in self.handles or _allowed_type(v)

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
                items = [self.decode(x) for x in _list(v.get("v"))]
                return {"tuple": tuple, "list": list, "set": set, "deque": collections.deque,
                        "fset": frozenset}[tag](items)
            if tag == "dict":
                return {self.decode(k): self.decode(x) for k, x in (_pair(p) for p in _list(v.get("v")))}
            if tag == "bytes":
                return wire.unb64(v.get("v"))
            if tag == "slice":
                return slice(*[self.decode(x) for x in _list(v.get("v"))][:3])
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


class Loopback:
    """Two endpoints in one process that call each other directly, every message through JSON: the same
    copies, handles and checks as a real channel, without a process (for tests)."""

    def __init__(self) -> None:
        self.parent = Endpoint(strict=True)
        self.worker = Endpoint()
        self.parent.peer, self.worker.peer = self.worker, self.parent


# -- helpers ----------------------------------------------------------------------------------------


def _list(v) -> list:
    if not isinstance(v, list):
        raise ChannelBroken("a list was expected: not the lab's protocol")
    return v


def _dict(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ChannelBroken("a dict was expected: not the lab's protocol")
    return v


def _pair(p):
    if not isinstance(p, list) or len(p) != 2:
        raise ChannelBroken("a dict entry was expected: not the lab's protocol")
    return p


def _take(obj) -> list:
    out = []
    for item in obj:
        out.append(item)
        if len(out) > MAX_ITEMS:
            raise OverflowError(f"more than {MAX_ITEMS} items: an iteration that does not end?")
    return out


def _allowed_type(v) -> bool:
    t = type(v)
    return t in CONTAINERS or t.__qualname__ in ALLOWED.get(t.__module__, ())


def _is_bound_method(v) -> bool:
    return type(v).__name__ in ("method", "builtin_function_or_method", "method-wrapper") and \
        getattr(v, "__self__", None) is not None and type(v.__self__).__name__ != "module"


def _is_event(v) -> bool:
    from nanoserve import events as ev
    return is_dataclass(v) and isinstance(v, ev.Event)


def _event(ep: Endpoint, v: dict):
    from nanoserve import events as ev
    cls = getattr(ev, str(v.get("c")), None)
    if not (isinstance(cls, type) and issubclass(cls, ev.Event) and is_dataclass(cls)):
        raise ValueError("not an event of nanoserve.events")
    values = {str(k): ep.decode(x) for k, x in _dict(v.get("f")).items()}
    return cls(**values)


def _enum(v: dict):
    module, _, qual = str(v.get("c")).partition(":")
    if not module.startswith("nanoserve."):
        raise ValueError("an enum from outside nanoserve")
    cls = getattr(importlib.import_module(module), qual, None)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise ValueError("not an enum")
    return cls[str(v.get("n"))]


def _special(v, copy_generator: bool = True):
    """Tensors, generators, dtypes and devices, without importing torch when it is not loaded."""
    module = type(v).__module__
    if not module.startswith("torch"):
        return None
    import torch
    if isinstance(v, torch.Tensor):
        return wire.tensor_to_wire(v)
    if isinstance(v, torch.Generator):
        return wire.generator_to_wire(v) if copy_generator else None
    if isinstance(v, torch.dtype):
        return {"T": "dtype", "v": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"T": "device", "v": str(v)}
    return None


def _snapshot(v):
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


def _changed(before, now) -> bool:
    import torch
    if isinstance(now, torch.Generator):
        return not torch.equal(before, now.get_state())
    return before.shape != now.shape or not torch.equal(before, now)


def _copy_back(original, new) -> None:
    """The callee changed a tensor (or advanced a generator) it was given a copy of: change ours the same way."""
    import torch
    if isinstance(original, torch.Tensor) and isinstance(new, torch.Tensor):
        if original.shape != new.shape:
            raise ValueError(f"the call changed a tensor's shape in place ({tuple(original.shape)} -> "
                             f"{tuple(new.shape)})")
        original.copy_(new.to(original.dtype))
    elif isinstance(original, torch.Generator) and isinstance(new, torch.Generator):
        original.set_state(new.get_state())


def worker_helper(module, name: str, *args):
    """Run the lab helper `name` ("nanoserve.labs.x:function") on the student's `module`, where the module lives:
    through the channel for a worker's module, here for one loaded in this process (`--lab` on the TUI)."""
    if isinstance(module, Proxy):
        return module._rpc_ep.call({"op": "helper", "f": name}, (module, *args), {})
    module_name, _, function = name.partition(":")
    return getattr(importlib.import_module(module_name), function)(module, *args)
