"""The clients panel (attach mode): who is talking to the server, one row per HTTP request.

The engine only knows request ids; the server knows where each came from.
Rows: requests in flight (oldest first), then the recently finished ones
(newest first) with how they ended: done, disconnected (the client hung up
and the request was aborted), rejected (429: the waiting queue was full) or
error. The title counts them and the /events watchers (this TUI is one).
A Textual `DataTable`, refilled from the server's table a few times a second.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

STATE_STYLE = {"queued": "#e5c07b", "running": "bold #98c379", "done": "dim", "disconnected": "#d19a66",
               "rejected": "bold #e06c75", "error": "bold #e06c75"}
COLUMNS = ("request", "client", "kind", "state", "tokens", "age")


def rows(table: dict, now: float | None = None) -> list[tuple]:
    """The table's requests as display rows: in flight first, then recent."""
    now = time.time() if now is None else now
    out = []
    for entry in table.get("live", []) + table.get("recent", []):
        end = entry["finished"] or now
        kind = ("chat" if entry["endpoint"] == "chat" else "text") + (" ⇢" if entry["stream"] else "")
        who = entry["client"] + (f" ({entry['user']})" if entry.get("user") else "")
        out.append((entry["request_id"], who, kind, Text(entry["state"], STATE_STYLE.get(entry["state"], "")),
                    str(entry["tokens"]), f"{end - entry['started']:.1f}s"))
    return out


def title(table: dict) -> str:
    live, watchers = len(table.get("live", [])), len(table.get("watchers", []))
    return f"clients · {live} in flight · {watchers} watching"


class ClientsPanel(DataTable):
    DEFAULT_CSS = """
    ClientsPanel {
        height: 2fr;
    }
    """

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.zebra_stripes = True
        self.add_columns(*COLUMNS)
        self.border_title = "clients"

    def show(self, table: dict) -> None:
        self.clear()
        self.add_rows(rows(table))
        self.border_title = title(table)

    @property
    def text(self) -> str:
        """What the rows say, as plain text (for tests)."""
        return "\n".join(" ".join(str(c) for c in self.get_row_at(i)) for i in range(self.row_count))
