"""What one client may take from the server, and what every error looks like.

* Every accepted connection has TCP_NODELAY (the listening socket is made with IPPROTO_TCP,
  which asyncio needs to set it): without it, each response after the first on a keep-alive
  connection waited ~40 ms for the client's delayed ACK.
* A body larger than --max-request-bytes is a 413 (said by Content-Length, or counted while a
  chunked body arrives); a body that does not arrive in time is a 408; a connection whose
  headers trickle in (slowloris) is closed; the server answers everyone else meanwhile.
* Every 4xx and 5xx is an OpenAI-shaped error body, the framework's own included (unknown
  route, wrong method, a body nested 100,000 deep, an empty body, an exception nobody caught).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from serve_helpers import check_clean, running_server, wait_idle

from nanoserve.models.loader import load_model
from nanoserve.serve import limits
from nanoserve.serve.listener import listen

CONFIG = dict(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
LIMIT = 50_000      # --max-request-bytes of these servers


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture
def server(loaded):
    with running_server(loaded, CONFIG, max_request_bytes=LIMIT) as (url, srv):
        yield url, srv


def is_openai_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else error["type"])
    for word in words:
        assert word in error["message"], error
    return error


def ok(url: str, model: str) -> None:
    resp = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2},
                      timeout=60)
    assert resp.status_code == 200, resp.text


# -- TCP_NODELAY ---------------------------------------------------------------------------------


def nodelay_of_accepted(sock: socket.socket) -> int:
    """TCP_NODELAY of the connection asyncio accepts on `sock` (the path uvicorn takes)."""
    async def main() -> int:
        seen = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    return asyncio.run(main())


def test_the_listener_gives_every_connection_tcp_nodelay():
    assert nodelay_of_accepted(listen("127.0.0.1", 0)) != 0
    # Why the protocol matters: the socket `socket.create_server` makes gets no TCP_NODELAY from asyncio.
    assert nodelay_of_accepted(socket.create_server(("127.0.0.1", 0))) == 0


def test_the_servers_connections_have_tcp_nodelay(loaded, monkeypatch):
    seen = []
    made = limits.HeaderTimeoutH11.connection_made

    def connection_made(self, transport):
        seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        made(self, transport)

    monkeypatch.setattr(limits.HeaderTimeoutH11, "connection_made", connection_made)
    with running_server(loaded, CONFIG) as (url, srv):
        with httpx.Client(timeout=60) as keep_alive:
            for _ in range(3):
                assert keep_alive.get(url + "/health").status_code == 200
    assert seen and all(seen), seen


# -- the request body ------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413(server, loaded):
    url, srv = server
    body = {"model": loaded.name, "prompt": "x" * LIMIT, "max_tokens": 2}
    is_openai_error(httpx.post(url + "/v1/completions", json=body, timeout=60), 413, "--max-request-bytes")

    def chunks():                                    # no Content-Length: counted as it arrives
        data = json.dumps(body).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    resp = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                      timeout=60)
    is_openai_error(resp, 413, str(LIMIT))
    ok(url, loaded.name)


def test_a_body_that_does_not_arrive_is_408(server, loaded, monkeypatch):
    url, srv = server
    monkeypatch.setattr(limits.BodyLimit, "timeout_s", 0.5)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\":")
        answer = b""
        while chunk := s.recv(65536):                # until the server closes (Connection: close)
            answer += chunk
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    ok(url, loaded.name)


def test_slow_headers_are_cut_and_everyone_else_is_served(server, loaded, monkeypatch):
    """Slowloris: 50 connections sending their headers a byte at a time. The server closes them
    after the header timeout and answers a normal client meanwhile."""
    url, srv = server
    monkeypatch.setattr(limits.HeaderTimeoutH11, "header_timeout_s", 1.0)
    port = int(url.rsplit(":", 1)[1])
    slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(50)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        ok(url, loaded.name)                          # served while the 50 hang
        deadline = time.monotonic() + 30
        for s in slow:                                # each is closed by the server: recv gives b""
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1024) == b""
    finally:
        for s in slow:
            s.close()
    ok(url, loaded.name)
    wait_idle(srv)
    check_clean(srv)


# -- error bodies --------------------------------------------------------------------------------


def test_framework_errors_are_openai_shaped(server, loaded):
    url, srv = server
    headers = {"content-type": "application/json"}
    is_openai_error(httpx.post(url + "/v1/nothing", json={}, timeout=30), 404, "no route POST /v1/nothing")
    resp = httpx.get(url + "/v1/completions", timeout=30)
    is_openai_error(resp, 405, "GET /v1/completions is not allowed")
    assert resp.headers["allow"] == "POST"
    deep = "[" * 20_000 + "]" * 20_000               # 40 kB, under the limit, too deep for the parser
    is_openai_error(httpx.post(url + "/v1/completions", content=deep, headers=headers, timeout=30), 400,
                    "could not be parsed as JSON (nested too deeply)")
    is_openai_error(httpx.post(url + "/v1/completions", content=b"", headers=headers, timeout=30), 400,
                    "has no body")
    is_openai_error(httpx.post(url + "/v1/completions", content=b"[1, 2]", headers=headers, timeout=30), 400,
                    "must be a JSON object")
    ok(url, loaded.name)


def test_a_request_http_cannot_parse_gets_json_too(server, loaded):
    url, srv = server
    port = int(url.rsplit(":", 1)[1])
    for raw in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(raw)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        head, body = answer.decode().split("\r\n\r\n", 1)
        assert head.startswith("HTTP/1.1 400") and "application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http_request"
    ok(url, loaded.name)


def test_deep_json_under_the_default_limit(loaded):
    """100,000 levels (200 kB): the body limit's default lets it through, the parser refuses it in one line."""
    with running_server(loaded, CONFIG) as (url, srv):
        deep = "[" * 100_000 + "]" * 100_000
        resp = httpx.post(url + "/v1/completions", content=deep, headers={"content-type": "application/json"},
                          timeout=60)
        is_openai_error(resp, 400, "nested too deeply")
        ok(url, loaded.name)


def test_an_uncaught_exception_is_an_openai_shaped_500(server, loaded, monkeypatch):
    url, srv = server
    monkeypatch.setattr(srv.book, "table", lambda: 1 / 0)
    is_openai_error(httpx.get(url + "/clients", timeout=30), 500, "ZeroDivisionError")
    monkeypatch.undo()
    assert httpx.get(url + "/clients", timeout=30).status_code == 200


def test_stream_options_without_stream_is_400(server, loaded):
    url, srv = server
    body = {"model": loaded.name, "prompt": "hi", "stream_options": {"include_usage": True}}
    error = is_openai_error(httpx.post(url + "/v1/completions", json=body, timeout=30), 400, "stream=true")
    assert error["param"] == "stream_options"
    ok(url, loaded.name)
