"""`nanoserve web --shared`: one app process for every browser tab, drawn once.

textual-serve gives each tab its own app process, which is what a student
stepping their own replay wants, and costs a process per tab. A class that
watches one thing (an attached server, the teacher's replay or live engine)
needs one screen, not thirty copies of it: `SharedApp` runs the app once, at a
fixed size, through textual-serve's own `AppService`, and sends every byte of
its screen to every tab. Thirty tabs then cost one app plus thirty websocket
writes (benchmarks/bench_web.py measures both ways).

* A tab that joins late has seen none of the screen: the app is sent Ctrl+L,
  which the TUI answers by drawing its whole screen again (`action_redraw`).
* Only tabs from this machine type into the app (the teacher's browser, on
  the machine running `nanoserve web`); other tabs watch. One student's arrow
  key would otherwise move everyone's screen.
* The app keeps running while a tab is open; when the last tab closes it is
  told to quit, and the next tab starts it again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

import psutil
from aiohttp import web
from textual_serve.app_service import AppService
from textual_serve.download_manager import DownloadManager

from nanoserve_tui.web_frames import BadFrame, read_frame, websocket_peer

log = logging.getLogger("nanoserve.web")
SIZE = (160, 50)          # the shared screen, in cells: the size the docs' screenshots and a projector use
REDRAW = b"\x0c"          # Ctrl+L


def this_machine() -> set[str]:
    """Every address of this machine (a teacher may open the page by its network address)."""
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs} | {"127.0.0.1", "::1"}


def from_this_machine(remote: str | None, local: set[str]) -> bool:
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote)
    except ValueError:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip   # ::ffff:127.0.0.1 on a dual-stack socket is 127.0.0.1
    return ip.is_loopback or str(ip) in local


class SharedApp:
    """One app, many tabs: see the module docstring."""

    def __init__(self, command: str, downloads: DownloadManager, size: tuple[int, int] = SIZE) -> None:
        self.command, self.downloads, self.size = command, downloads, size
        self.tabs: set[web.WebSocketResponse] = set()
        self.service: AppService | None = None
        self.local = this_machine()
        self._lock = asyncio.Lock()     # tabs join and leave one at a time (the app starts and stops here)

    async def serve(self, request: web.Request) -> web.WebSocketResponse:
        """One tab: join, pass its keys on if it may type, leave."""
        ws = web.WebSocketResponse(heartbeat=15)
        await ws.prepare(request)
        may_type = from_this_machine(request.remote, self.local)
        await self._join(ws)
        try:
            async for message in ws:
                try:
                    kind, data = read_frame(message)
                except BadFrame as exc:                 # one line, no traceback; this tab only
                    log.warning("a tab from %s sent %s; its session ends", websocket_peer(ws), exc)
                    await ws.close()
                    break
                if kind == "stdin" and may_type and self.service is not None:
                    await self.service.send_bytes(data.encode("utf-8", "replace"))
                elif kind == "ping":
                    await ws.send_json(["pong", data])
                # "resize", "focus", "blur": the shared screen keeps its size and its focus
        finally:
            await self._leave(ws)
        return ws

    async def _join(self, ws: web.WebSocketResponse) -> None:
        async with self._lock:
            self.tabs.add(ws)
            if self.service is None:
                self.service = AppService(self.command, write_bytes=self._to_tabs, write_str=self._text_to_tabs,
                                          close=self._app_ended, download_manager=self.downloads)
                await self.service.start(*self.size)
            else:
                await self.service.send_bytes(REDRAW)      # the newcomer needs the whole screen

    async def _leave(self, ws: web.WebSocketResponse) -> None:
        async with self._lock:
            self.tabs.discard(ws)
            if not self.tabs and self.service is not None:
                service, self.service = self.service, None
                await service.stop()

    async def _to_tabs(self, data: bytes) -> None:
        await asyncio.gather(*(self._send(ws, ws.send_bytes, data) for ws in list(self.tabs)))

    async def _text_to_tabs(self, text: str) -> None:
        await asyncio.gather(*(self._send(ws, ws.send_str, text) for ws in list(self.tabs)))

    async def _send(self, ws: web.WebSocketResponse, send, data) -> None:
        try:
            await asyncio.wait_for(send(data), 10)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError):   # gone, or too slow to keep up
            self.tabs.discard(ws)
            await ws.close()

    async def _app_ended(self) -> None:
        """The app quit (q from this machine): every tab's session ends; the next tab starts it again."""
        self.service = None
        for ws in list(self.tabs):
            await ws.close()
