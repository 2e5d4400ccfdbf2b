"""The server's connections send small writes at once: TCP_NODELAY on every accepted socket.

Without it a response on a reused connection, or a streamed chunk, can wait for
the client's delayed ACK (about 40 ms). asyncio sets TCP_NODELAY itself, but only
on sockets whose protocol is IPPROTO_TCP; `tcp_listener` names it.
"""

from __future__ import annotations

import asyncio
import gc
import socket

from nanoserve.serve.background import BackgroundServer, tcp_listener


def accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY of the connection an asyncio server accepted on `listener` (what uvicorn runs on)."""
    async def main() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value

    return asyncio.run(main())


def test_tcp_listener_connections_have_nodelay():
    assert accepted_nodelay(tcp_listener("127.0.0.1", 0)) != 0


def test_a_plain_listener_would_not():
    """Why tcp_listener exists: the default socket's protocol is 0, and asyncio then leaves Nagle on."""
    assert accepted_nodelay(socket.create_server(("127.0.0.1", 0))) == 0


def test_background_server_connections_have_nodelay():
    """End to end through uvicorn: the server side of a client's connection has TCP_NODELAY."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/nodelay")
    def nodelay(port: int) -> dict:   # the server's end of the connection whose client port is `port`
        for obj in gc.get_objects():
            if isinstance(obj, asyncio.trsock.TransportSocket):
                try:
                    if obj.getpeername()[1] == port:
                        return {"nodelay": obj.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)}
                except OSError:
                    continue
        return {"nodelay": None}

    with BackgroundServer(app) as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        port = conn.getsockname()[1]
        conn.sendall(f"GET /nodelay?port={port} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        response = b""
        while chunk := conn.recv(4096):
            response += chunk
    assert b'{"nodelay":1}' in response, response
