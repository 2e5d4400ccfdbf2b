"""A server on a loopback port in a background thread: for tests, lessons, docs examples, benchmarks.

    with BackgroundServer(build_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        ...

It binds 127.0.0.1 on a free port the OS picks (so parallel runs never
collide), runs uvicorn's server loop on a thread, waits until it accepts
connections, and on exit asks it to stop and waits (bounded) for the thread.
`nanoserve serve` does not use it: there uvicorn runs in the main thread. Both
listen the same way (`listener.py`: TCP_NODELAY, the header timeout).
"""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from nanoserve.serve.listener import listen, server_config


class Uvicorn(uvicorn.Server):
    """uvicorn's server, ending the app's /events streams when shutdown begins.

    uvicorn waits (up to timeout_graceful_shutdown) for open connections before it
    runs the app's shutdown; an endless event stream would hold it for the whole
    timeout. Requests still generating finish normally if they can within the grace
    period (the engine loop stops last); a second before it ends, those still running
    get a 503 that says the server is shutting down (a stream ends with it and [DONE]).
    """

    async def shutdown(self, sockets=None) -> None:
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        timer = None
        if server is not None:
            server.hub.close_all()
            grace = self.config.timeout_graceful_shutdown
            if grace is not None:   # a second before uvicorn would cancel them (a traceback each, a cut stream)
                timer = asyncio.get_running_loop().call_later(
                    max(grace - 1.0, 0.0), server.engine_loop.end_requests,
                    f"the server is shutting down: this request was stopped after a {grace} s grace period")
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


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
        sock = listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = server_config(self.app, lifespan="on", timeout_graceful_shutdown=5)
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
