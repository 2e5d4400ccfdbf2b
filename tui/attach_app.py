"""The TUI attached to a server: the live view of `NanoserveApp`, plus a clients panel.

    nanoserve tui --attach http://127.0.0.1:8000 [--api-key KEY]

`AttachApp` is `NanoserveApp` with an `AttachSource` (attach.py): the same
panels drawn from the same frames, so a server looks exactly like a local
live engine. It adds the clients panel under the request list and keeps the
controls that would change the engine (step, add, abort, fork, presets)
read-only: they explain why instead.
"""

from __future__ import annotations

import os
import sys

from textual import on

from nanoserve_tui.app import NanoserveApp
from nanoserve_tui.attach import READ_ONLY, AttachSource, ClientsReady
from nanoserve_tui.widgets.clients import ClientsPanel

API_KEY_ENV = "NANOSERVE_API_KEY"


class AttachApp(NanoserveApp):
    def __init__(self, source: AttachSource) -> None:
        super().__init__(source)

    def on_mount(self) -> None:
        # (Textual runs NanoserveApp.on_mount too, first: handlers are called along the class hierarchy)
        self.query_one("#right").mount(ClientsPanel(id="clients", classes="panel"), after="#requests")

    @on(ClientsReady)
    def _clients_ready(self, message: ClientsReady) -> None:
        panels = self.query(ClientsPanel)
        if panels:
            panels.first().show(message.table)

    def action_presets(self) -> None:
        self.notify(f"{READ_ONLY}: presets start a local engine (quit and run `nanoserve tui --scenario NAME`)",
                    severity="warning")


def run_attach(url: str, api_key: str | None = None, scenario: str | None = None) -> int:
    """`nanoserve tui --attach URL`; returns the exit code (2 on a bad URL or a server it cannot reach)."""
    if scenario is not None:
        print("nanoserve: error: --attach watches a server; it takes no --scenario", file=sys.stderr)
        return 2
    try:
        source = AttachSource(url, api_key or os.environ.get(API_KEY_ENV) or None)
    except ValueError as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        return 2
    app = AttachApp(source)
    app.run()
    if app.error:
        print(f"nanoserve: error: {app.error}", file=sys.stderr)
        return 2
    return app.return_code or 0
