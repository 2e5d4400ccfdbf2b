"""The checker's (or the worker's) stand-in for an object of the other process: attribute access, calls
and the container protocol are requests on the lab's channel (`remote.py`).

`Proxy` stands for one object, by its handle; `RemoteMethod` for one of its methods (calling it is one
request). A list, dict, set or deque compares by value (`==` fetches a copy); any other object is equal
only to itself, and two handles to one object are one proxy, so `is` and `in` work as they would here.
Nothing of the other side is ever pickled or copied through a proxy.
"""

from __future__ import annotations

import collections

CONTAINERS = {list: "list", dict: "dict", set: "set", collections.deque: "deque",
              collections.Counter: "dict", collections.defaultdict: "dict", collections.OrderedDict: "dict"}
CONTAINER_KINDS = set(CONTAINERS.values())


class Proxy:
    """An object on the other side of the channel. Attribute access, calls and the container protocol
    are requests; `==` on a list/dict/set/deque compares copies; other objects are equal only to themselves."""

    __slots__ = ("_rpc_ep", "_rpc_h", "_rpc_kind", "_rpc_type", "__weakref__")

    def __init__(self, ep, handle: int, kind: str, type_name: str) -> None:
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
        if self._rpc_kind in CONTAINER_KINDS:
            mine = self._value()
            theirs = other._value() if isinstance(other, Proxy) and other._rpc_kind in CONTAINER_KINDS else other
            return mine == theirs
        return self is other

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        if self._rpc_kind in CONTAINER_KINDS:
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
