"""What one client may take from the server: bytes, and time to send them.

One engine serves everyone, so a single hostile or broken client must not be
able to hold it or every connection:

* `BodyLimit` (ASGI middleware): a request body larger than `max_bytes` gets
  413 before it is read further (at once when Content-Length says so), and a
  body that does not arrive whole within `timeout_s` gets 408. The body is
  read here, then handed to the app as it came.
* `HeaderTimeoutH11` (uvicorn's h11 protocol, a few lines more): a connection
  that has not sent a request's headers within `HEADER_TIMEOUT_S` of opening,
  or of its last response, is closed; a request h11 cannot parse gets an
  OpenAI-shaped 400, not uvicorn's plain text. uvicorn closes idle keep-alive
  connections (`timeout_keep_alive`) but waits forever for headers that
  trickle in byte by byte (slowloris): 150 such connections stayed open, and
  with 256 open files allowed, 400 made `accept` fail for everyone.

The socket itself (TCP_NODELAY, the open-file limit) is `listener.py`'s.
"""

from __future__ import annotations

import asyncio
import json
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve.serve.protocol import ApiError

MAX_BODY_BYTES = 4 * 1024 * 1024   # a request body; --max-request-bytes
BODY_TIMEOUT_S = 30.0              # to send the whole body once the headers are in
HEADER_TIMEOUT_S = 10.0            # to send a request's headers after connecting (or after a response)


class BodyLimit:
    """ASGI middleware: 413 past `max_bytes`, 408 past `timeout_s`; an OpenAI-shaped error body either way."""

    timeout_s = BODY_TIMEOUT_S

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, send, 413, f"the request body has {int(length)} bytes; this server "
                                                 f"takes at most {self.max_bytes} (--max-request-bytes)")
            return
        chunks, size, deadline = [], 0, time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._refuse(scope, send, 408, f"the request body did not arrive within "
                                                     f"{self.timeout_s:g} s")
                return
            if message["type"] == "http.disconnect":
                return                               # the client left before its body was in: nothing to do
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, send, 413, f"the request body is larger than {self.max_bytes} "
                                                     f"bytes (--max-request-bytes)")
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                   # then: the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, send, status: int, message: str) -> None:
        from fastapi.responses import JSONResponse

        error = ApiError(status, message, code="request_too_large" if status == 413 else "request_timeout")
        response = JSONResponse(error.body(), status_code=status, headers={"Connection": "close"})
        await response(scope, None, send)


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers do not come in time."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:   # no request in progress: headers never came
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:                 # a request's headers are in: its handler has the time now
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():         # keep-alive: the next request's headers must come in time
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad request line, headers too large): the OpenAI error shape
        too, not uvicorn's plain text."""
        body = json.dumps(ApiError(400, f"the HTTP request could not be parsed ({msg})",
                                   code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:        # (h11 cannot answer in its state: close, as uvicorn would)
            pass
        self.transport.close()
