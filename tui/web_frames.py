"""What a browser tab may send `nanoserve web`: its terminal size, clamped, and its frames, checked.

A tab speaks textual-serve's protocol over its websocket: the size it opens
with (`/ws?width=COLS&height=ROWS`), then text frames, each a JSON array:

    ["stdin", "text typed"]     ["resize", {"width": 120, "height": 40}]
    ["ping", "id"]              ["focus"]    ["blur"]

The app behind a tab draws a screen of the size the tab asks for, so a size
is clamped to MAX_SIZE (a tab asking for 100000 x 100000 cells would make its
app grow by gigabytes). A frame that is not that (binary, not JSON, `[]`,
`["stdin", 5]`) ends the tab: `read_frame` raises BadFrame, and the server
logs one line, with no traceback (`web_server.py`, `web_shared.py`). Kinds
the protocol may add later are passed on as they are, for the server to ignore.
"""

from __future__ import annotations

import json

from aiohttp import WSMessage, WSMsgType

MAX_SIZE = (500, 200)     # columns, rows: a 4K screen at a small font; more is refused as a clamp, not an error
DEFAULT_SIZE = (80, 24)


class BadFrame(ValueError):
    """A frame a tab should never send; the message says what was wrong, in one line."""


def clamp_size(width, height) -> tuple[int, int]:
    """(columns, rows) from a tab's numbers (text from a query, or JSON numbers), within 1..MAX_SIZE;
    what is not a number gets the default."""
    return _clamp(width, DEFAULT_SIZE[0], MAX_SIZE[0]), _clamp(height, DEFAULT_SIZE[1], MAX_SIZE[1])


def _clamp(value, default: int, most: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return max(1, min(most, number))


def read_frame(message: WSMessage) -> tuple[str, object]:
    """(kind, data) of one frame from a tab: data is the typed text, the clamped (cols, rows) of a resize,
    a ping's id, or None. BadFrame for anything else."""
    if message.type != WSMsgType.TEXT:
        raise BadFrame(f"a {message.type.name.lower()} frame (the protocol sends text)")
    try:
        envelope = json.loads(message.data)
    except ValueError:
        raise BadFrame(f"a frame that is not JSON: {message.data[:40]!r}") from None
    if not isinstance(envelope, list) or not envelope or not isinstance(envelope[0], str):
        raise BadFrame(f"a frame that is not [kind, data]: {message.data[:40]!r}")
    kind, data = envelope[0], envelope[1] if len(envelope) > 1 else None
    if kind == "stdin" and not isinstance(data, str):
        raise BadFrame(f"a stdin frame without text: {message.data[:40]!r}")
    if kind == "resize":
        if not isinstance(data, dict):
            raise BadFrame(f"a resize frame without a size: {message.data[:40]!r}")
        return kind, clamp_size(data.get("width"), data.get("height"))
    return kind, data


def websocket_peer(ws) -> str:
    """The tab's address, for a log line ("?" when the connection is gone)."""
    peer = ws.get_extra_info("peername")
    return str(peer[0]) if peer else "?"
