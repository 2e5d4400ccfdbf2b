"""A server on a loopback port in a background thread: for tests, lessons, docs examples, benchmarks.

    with BackgroundServer(build_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        ...

It binds 127.0.0.1 on a free port the OS picks (so parallel runs never
collide), runs uvicorn's server loop on a thread, waits until it accepts
connections, and on exit asks it to stop and waits (bounded) for the thread.
`nanoserve serve` does not use it: there uvicorn runs in the main thread; both
listen on `tcp_listener`'s socket, so every connection sends small writes at once.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket whose accepted connections send each write at once (TCP_NODELAY).

    asyncio turns Nagle's algorithm off on a connection only when its socket says it is TCP
    (`asyncio.base_events._set_nodelay` checks `sock.proto == IPPROTO_TCP`). `socket.socket(AF_INET,
    SOCK_STREAM)` and `socket.create_server` leave the protocol 0, accepted sockets inherit it, and
    then a small write (a response on a reused connection, a streamed chunk) can wait for the
    client's delayed ACK, about 40 ms. Naming the protocol here is the whole fix;
    tests/test_serve_nodelay.py checks an accepted connection's TCP_NODELAY."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restart need not wait for TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Uvicorn(uvicorn.Server):
    """uvicorn's server, ending the app's /events streams when shutdown begins.

    uvicorn waits (up to timeout_graceful_shutdown) for open connections before it
    runs the app's shutdown; an endless event stream would hold it for the whole
    timeout. Requests still generating finish normally: the engine loop stops last.
    """

    async def shutdown(self, sockets=None) -> None:
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        if server is not None:
            server.hub.close_all()
        await super().shutdown(sockets)


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0) -> None:
        self.app, self.host, self.port = app, host, port
        self.start_timeout = start_timeout
        self._server: Uvicorn | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        sock = tcp_listener(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self._server = Uvicorn(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="nanoserve-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(5)

    def __exit__(self, *exc) -> None:
        self.stop()
