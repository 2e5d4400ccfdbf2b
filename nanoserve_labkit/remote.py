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

import importlib
import json
import time

from nanoserve_labkit import wire
from nanoserve_labkit.codec import Codec, Refused, allowed_type, as_dict, as_list, take
from nanoserve_labkit.proxy import Proxy
from nanoserve_labkit.wire import ChannelBroken, Deadline

__all__ = ["Endpoint", "Loopback", "Proxy", "Refused", "worker_helper"]


class Endpoint(Codec):
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
        self.withheld_types: frozenset = frozenset()   # (module, class) never handed to the worker (the parent)

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
            wire.copy_back(original, self.decode(value))
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
            args = [self.decode(a) for a in as_list(m.get("a"))]
            kwargs = {str(k): self.decode(v) for k, v in as_dict(m.get("k")).items()}
            snap = {i: wire.snapshot(a) for i, a in enumerate(args)} | {k: wire.snapshot(v) for k, v in kwargs.items()}
            value = fn(*args, **kwargs)
            back = []
            for where, before in snap.items():
                now = args[where] if isinstance(where, int) else kwargs[where]
                if before is not None and wire.changed(before, now):
                    back.append([where, self.encode(now, by_value=True, guard=self.strict, argument=True)])
            return value, back, True
        target = self._target(m)
        if op == "getattr":
            return getattr(target, self._name(m)), None, False
        if op == "setattr":
            name = self._name(m)
            if self.strict and (not allowed_type(target) or not hasattr(target, name)):
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
            return take(target), None, True        # the items themselves are shared
        if op == "value":
            return target, None, "deep"
        if op == "repr":
            return repr(target)[:10_000], None, True
        raise ChannelBroken(f"an unknown request {op!r}: not the lab's protocol")

    # -- values ----------------------------------------------------------------------------------

class Loopback:
    """Two endpoints in one process that call each other directly, every message through JSON: the same
    copies, handles and checks as a real channel, without a process (for tests)."""

    def __init__(self) -> None:
        self.parent = Endpoint(strict=True)
        self.worker = Endpoint()
        self.parent.peer, self.worker.peer = self.worker, self.parent



def worker_helper(module, name: str, *args):
    """Run the lab helper `name` ("nanoserve.labs.x:function") on the student's `module`, where the module lives:
    through the channel for a worker's module, here for one loaded in this process (`--lab` on the TUI)."""
    if isinstance(module, Proxy):
        return module._rpc_ep.call({"op": "helper", "f": name}, (module, *args), {})
    module_name, _, function = name.partition(":")
    return getattr(importlib.import_module(module_name), function)(module, *args)
