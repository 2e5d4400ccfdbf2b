"""The web server of `nanoserve web`: textual-serve, with a key, a seat limit and a bound socket.

textual-serve (`textual_serve.server.Server`) does the real work: a page with
xterm.js, and for every browser tab that opens its websocket, one subprocess
running the app on Textual's web driver, its screen streamed to the tab and
the tab's keys and mouse streamed back. `WebServer` adds what a classroom
needs around it, and nothing inside the app:

* a key (`api_key`): every route needs it, given as `Authorization: Bearer
  KEY` (as `nanoserve serve` takes it), as the password of the browser's own
  sign-in box (HTTP Basic, any user name), or once as `/?key=KEY` in a link;
  after that a cookie carries it, so the websocket and the page's scripts pass;
* a seat limit (`max_sessions`): the tab past it gets a page that says so,
  not one more app process on a machine that cannot hold it;
* a socket bound by the caller (a busy port is one line before anything
  starts), and websocket URLs made from the address the browser used (a
  server on 0.0.0.0 is reached as 192.168.x.y, not as 0.0.0.0);
* its own page (`web.html`), without the web fonts textual-serve's page
  fetches from the internet.

With `shared`, every tab shows one app process instead (web_shared.py). What
runs (`command`) and what to tell the user is decided in web_command.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import socket
from pathlib import Path

import aiohttp_jinja2
import psutil
from aiohttp import web
from textual_serve.server import Server

from nanoserve_tui.web_frames import BadFrame, clamp_size, read_frame, websocket_peer
from nanoserve_tui.web_shared import SharedApp

log = logging.getLogger("nanoserve.web")
COOKIE = "nanoserve_web"
TEMPLATES = Path(__file__).parent   # web.html


class WebServer(Server):
    def __init__(self, command: str, title: str, api_key: str | None = None, max_sessions: int = 40,
                 note: str = "", shared: bool = False) -> None:
        super().__init__(command, title=title, templates_path=TEMPLATES)
        self.api_key = api_key
        self.max_sessions = max_sessions
        self.note = note            # a line under the title while the app starts, e.g. "every tab runs ..."
        self.sessions = 0           # websockets open now (one app process each, unless shared)
        self.shared = SharedApp(command, self.download_manager) if shared else None   # one app for all tabs

    # -- the key ------------------------------------------------------------------------

    def _token(self) -> str:
        """What the cookie holds: derived from the key, so the key itself is not stored in browsers."""
        return hmac.new(self.api_key.encode(), b"nanoserve web", hashlib.sha256).hexdigest()

    def _given(self, request: web.Request) -> bool:
        """Whether the request carries the key, in any of the forms the module docstring lists."""
        key = self.api_key.encode()
        header = request.headers.get("Authorization", "")
        kind, _, value = header.partition(" ")
        if kind.lower() == "bearer" and hmac.compare_digest(value.encode(), key):
            return True
        if kind.lower() == "basic":
            try:
                password = base64.b64decode(value).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                password = ""
            if hmac.compare_digest(password.encode(), key):
                return True
        if hmac.compare_digest(request.query.get("key", "").encode(), key):
            return True
        return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self._token().encode())

    @web.middleware
    async def _require_key(self, request: web.Request, handler):
        if self.api_key is None:
            return await handler(request)
        if not self._given(request):
            return web.Response(status=401, text="nanoserve web: this page needs the key: open it as "
                                                  "/?key=KEY, or sign in with the key as password\n",
                                headers={"WWW-Authenticate": 'Basic realm="nanoserve web: the key is the password"'})
        if "key" in request.query:          # a link with the key: keep it in a cookie, out of the address bar
            query = {k: v for k, v in request.query.items() if k != "key"}
            response = web.HTTPFound(request.rel_url.with_query(query))
            response.set_cookie(COOKIE, self._token(), httponly=True, samesite="Strict")
            raise response
        response = await handler(request)
        if request.path == "/" and COOKIE not in request.cookies:
            response.set_cookie(COOKIE, self._token(), httponly=True, samesite="Strict")
        return response

    # -- pages and sessions -------------------------------------------------------------

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        app.middlewares.append(self._require_key)
        return app

    async def handle_index(self, request: web.Request) -> web.Response:
        """The page: textual-serve's context, with URLs on the host the browser asked for."""
        if self.sessions >= self.max_sessions:
            return self._full()
        base = f"{request.scheme}://{request.host}"
        socket_url = ("wss" if request.scheme == "https" else "ws") + f"://{request.host}/ws"
        context = {
            "font_size": _int(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": socket_url,
            "config": {"static": {"url": f"{base}/static/"}},
            "application": {"name": self.title},
            "note": self.note,
            "shared": {"cols": self.shared.size[0], "rows": self.shared.size[1]} if self.shared else None,
        }
        return aiohttp_jinja2.render_template("web.html", request, context)

    async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
        """One browser tab: one app process (textual-serve's), while a seat is free."""
        if self.sessions >= self.max_sessions:
            return self._full()
        self.sessions += 1
        try:
            if self.shared is not None:
                return await self.shared.serve(request)
            width, height = clamp_size(request.query.get("width"), request.query.get("height"))
            request = request.clone(rel_url=request.rel_url.update_query(width=width, height=height))
            return await super().handle_websocket(request)
        finally:
            self.sessions -= 1

    async def _process_messages(self, websocket: web.WebSocketResponse, app_service) -> None:
        """One tab's frames to its app (textual-serve's loop, with every frame checked: web_frames.py);
        a malformed frame ends the tab with one log line."""
        async for message in websocket:
            try:
                kind, data = read_frame(message)
            except BadFrame as exc:
                log.warning("a tab from %s sent %s; its session ends", websocket_peer(websocket), exc)
                await websocket.close()
                return
            if kind == "stdin":
                await app_service.send_bytes(data.encode("utf-8", "replace"))
            elif kind == "resize":
                await app_service.set_terminal_size(*data)
            elif kind == "ping":
                await websocket.send_json(["pong", data])
            elif kind == "blur":
                await app_service.blur()
            elif kind == "focus":
                await app_service.focus()

    def _full(self) -> web.Response:
        why = "" if self.shared else " (each browser tab runs its own copy of the app)"
        return web.Response(status=503, text=f"nanoserve web: all {self.max_sessions} seats are taken{why}; "
                                             "close a tab and reload\n")

    async def on_startup(self, app: web.Application) -> None:
        """(textual-serve prints its logo here; `nanoserve web` has said what it serves already.)"""

    async def on_shutdown(self, app: web.Application) -> None:
        """Ctrl+C: end every tab's app process. A live tab may still be loading its model, deaf to the
        "quit" textual-serve sends it, and a process left running would outlive the server."""
        tabs = psutil.Process().children(recursive=True)
        for tab in tabs:
            tab.terminate()
        _, alive = await asyncio.to_thread(psutil.wait_procs, tabs, timeout=5)
        for tab in alive:
            tab.kill()

    def serve_on(self, sock: socket.socket) -> None:
        """Serve on a bound socket until Ctrl+C (or SIGTERM)."""
        logging.basicConfig(level=logging.WARNING, format="nanoserve web: %(message)s")
        web.run_app(self._make_app(), sock=sock, print=None, shutdown_timeout=2, handle_signals=True)


def _int(value: str, default: int) -> int:
    try:
        return int(value)
    except ValueError:
        return default
