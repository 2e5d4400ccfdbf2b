"""How the server listens: its socket, and the uvicorn settings every server here runs with.

`nanoserve serve` and `BackgroundServer` bind their own socket (so a port in
use is one clear line before the model loads, and a test gets a free port the
OS picks). Two details of that socket matter:

* It is created with `IPPROTO_TCP`. asyncio turns Nagle's algorithm off
  (`TCP_NODELAY`) on each accepted connection only when the listening
  socket says it is TCP; `socket.create_server` leaves the protocol 0, and
  then every response after the first on a keep-alive connection waited
  ~40 ms for the client's delayed ACK (2-token completions: 47.7 ms median
  against 11.3 ms for the first; each stream's first chunk 40 ms late).
* `raise_open_file_limit()` lets `nanoserve serve` keep as many connections
  as the system allows (the soft limit is often 1024, or 256), as vLLM does.

`server_config(app)` is uvicorn's Config with the limits of `limits.py`: the
h11 protocol that closes connections whose headers do not come in time, and a
keep-alive timeout.
"""

from __future__ import annotations

import socket

import uvicorn

from nanoserve.serve.limits import HeaderTimeoutH11

KEEP_ALIVE_S = 5          # an idle keep-alive connection is closed after this long (uvicorn's default)
BACKLOG = 2048            # connections the kernel queues before `accept`


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: one the OS picks); OSError if it cannot."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                     proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, socket.IPPROTO_TCP)   # (proto 0 would leave Nagle on: see above)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def server_config(app, **options) -> uvicorn.Config:
    """uvicorn's settings for `app`: quiet logs, the header timeout, keep-alive; `options` override."""
    settings = dict(log_level="warning", http=HeaderTimeoutH11, timeout_keep_alive=KEEP_ALIVE_S,
                    backlog=BACKLOG)
    return uvicorn.Config(app, **{**settings, **options})


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the limit now."""
    try:
        import resource
    except ImportError:                   # not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
