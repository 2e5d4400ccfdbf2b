"""Who is talking to the server: HTTP requests in flight and recently done, and /events watchers.

This module owns `ClientBook`, the table behind the TUI's clients panel
(`nanoserve tui --attach`) and `GET /clients`. The engine knows requests; only
the server knows that request `cmpl-7` came from 127.0.0.1:53412 as a
streaming chat, that it was refused with 429, or that its client hung up.
That is not engine state, so it travels beside the trace (as `event: clients`
on /events?clients=1), never inside it: a recorded trace stays the engine's.

Used from the asyncio thread only (the route handlers), so it needs no lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

RECENT = 32   # finished requests kept in the table, newest first


@dataclass(slots=True)
class ClientRequest:
    request_id: str
    client: str              # "host:port" of the connection
    user: str                # the request's `user` field, or ""
    endpoint: str            # "completions" | "chat"
    stream: bool
    state: str = "queued"    # queued -> running -> done | disconnected | rejected | error
    tokens: int = 0          # tokens sent back so far (all completions)
    started: float = 0.0     # time.time() when it arrived
    finished: float | None = None
    detail: str = ""         # the error message for rejected / error


class ClientBook:
    def __init__(self) -> None:
        self.live: dict[str, ClientRequest] = {}
        self.recent: deque[ClientRequest] = deque(maxlen=RECENT)
        self.watchers: dict[int, str] = {}    # /events connections: id -> "host:port"
        self.version = 0                      # bumped on every change, so watchers send only news
        self._next_watcher = 0

    def _changed(self) -> None:
        self.version += 1

    def open(self, request_id: str, client: str, user: str | None, endpoint: str, stream: bool) -> ClientRequest:
        entry = ClientRequest(request_id, client, user or "", endpoint, stream, started=time.time())
        self.live[request_id] = entry
        self._changed()
        return entry

    def update(self, request_id: str, state: str | None = None, tokens: int | None = None) -> None:
        entry = self.live.get(request_id)
        if entry is None:
            return
        if state is not None:
            entry.state = state
        if tokens is not None:
            entry.tokens = tokens
        self._changed()

    def close(self, request_id: str, state: str, detail: str = "") -> None:
        entry = self.live.pop(request_id, None)
        if entry is None:
            return
        entry.state, entry.detail, entry.finished = state, detail, time.time()
        self.recent.appendleft(entry)
        self._changed()

    def add_watcher(self, client: str) -> int:
        key, self._next_watcher = self._next_watcher, self._next_watcher + 1
        self.watchers[key] = client
        self._changed()
        return key

    def remove_watcher(self, key: int) -> None:
        if self.watchers.pop(key, None) is not None:
            self._changed()

    def table(self) -> dict:
        """Plain data for JSON: requests in flight (oldest first), recent ones (newest first), watchers."""
        return {"time": time.time(), "live": [asdict(e) for e in self.live.values()],
                "recent": [asdict(e) for e in self.recent], "watchers": sorted(self.watchers.values())}
