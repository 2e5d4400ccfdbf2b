"""Attach: frames from a running `nanoserve serve`, read from its /events stream.

    nanoserve tui --attach http://127.0.0.1:8000

The third source beside `LiveSource` (live_source.py) and `ReplaySource` (source.py), and the
same idea: the server's /events stream is a trace being written (one JSONL
trace line per SSE `data:`), so the TUI folds it with the same `fold()` and
draws the same frames a local live engine would give. Nothing here knows the
engine; it could be on another machine.

* `sse_messages(lines)` parses server-sent events (event type, data, id).
* `TraceFolder` folds trace lines into a `ViewState`, a whole batch at a
  time: the server marks the last event of each batch with an SSE id, and
  there the engine is between two steps.
* `AttachSource` reads the stream on a worker thread (httpx), folds it, and
  posts a frame at most `FPS` times a second (a tiny model steps faster than
  a terminal repaints); the server's client table goes to the clients panel.
  It is read-only: the server's clients drive the engine, so step, add,
  abort and fork say so. A lost connection is retried; the fold restarts
  from the fresh EngineSynced the server sends.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import urlparse

from textual.app import App
from textual.message import Message

from nanoserve.events import EngineSynced, Event, StepFinished, StepStarted
from nanoserve.trace import ViewState, event_from_dict, fold
from nanoserve_tui.source import Frame, FrameReady, Source, SourceStatus, Unsupported, acceptance_rate

FPS = 10                  # frames posted per second at most
RETRY_S = 2.0             # wait between reconnection attempts
READ_ONLY = "attached to a server: its clients drive the engine, this view only watches"


class ClientsReady(Message):
    """The server's client table (GET /clients) changed."""

    def __init__(self, table: dict) -> None:
        super().__init__()
        self.table = table


def sse_messages(lines: Iterable[str]) -> Iterator[tuple[str, str, str | None]]:
    """Server-sent events from text lines: (event type, data, id or None), one per blank-line-ended block."""
    kind, data, event_id = "message", [], None
    for line in lines:
        if not line:                                   # a blank line ends the message
            if data:
                yield kind, "\n".join(data), event_id
            kind, data, event_id = "message", [], None
            continue
        if line.startswith(":"):                       # a comment (heartbeat)
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            kind = value
        elif name == "id":
            event_id = value


class TraceFolder:
    """Folds a live stream of trace events into a view state, one batch at a time.

    `on_step(state)`, if given, is called after every batch that ends a step
    (tests compare those states with a local engine's).
    """

    def __init__(self, on_step: Callable[[ViewState], None] | None = None) -> None:
        self.state: ViewState | None = None
        self.recent: list[Event] = []          # the latest step's events (and arrivals after it)
        self.acceptance: tuple[float, ...] = ()
        self.on_step = on_step
        self._pending: list[Event] = []

    def feed(self, event: Event, batch_end: bool) -> bool:
        """Take one event; at a batch end fold what is pending. True when the state changed."""
        self._pending.append(event)
        if not batch_end:
            return False
        for e in self._pending:
            if isinstance(e, EngineSynced):
                self.recent, self.acceptance = [], ()
            if isinstance(e, StepStarted):
                self.recent = []
            self.recent.append(e)
            self.state = fold(self.state, e)
        rate = acceptance_rate(self._pending)
        if rate is not None:
            self.acceptance += (rate,)
        ended_step = isinstance(self._pending[-1], StepFinished)
        self._pending = []
        if ended_step and self.on_step is not None:
            self.on_step(self.state)
        return True


class AttachSource(Source):
    """Frames from a server's /events stream; see the module docstring."""

    mode = "attach"
    controls = frozenset()                     # read-only: the server's clients drive the engine

    def __init__(self, url: str, api_key: str | None = None, on_step: Callable[[ViewState], None] | None = None,
                 fps: float = FPS) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--attach needs a server URL like http://127.0.0.1:8000, got {url!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.description = self.url
        self.fps = fps
        self._folder = TraceFolder(on_step)
        self._lock = threading.Lock()          # the worker folds, the UI thread copies
        self._dirty = False
        self._clients: dict | None = None
        self._stop = threading.Event()
        self._response = None                  # the open /events response (closed to stop the worker)
        self._app: App | None = None

    # -- UI thread ---------------------------------------------------------------------

    def attach(self, app: App) -> None:
        self._app = app
        app.post_message(SourceStatus("loading", f"connecting to {self.url} …"))
        app.run_worker(self._listen, thread=True, name="attach", group="attach", exit_on_error=False)
        app.set_interval(1 / self.fps, self._publish)

    def _publish(self) -> None:
        """Post the newest state (a copy: posted frames never change) and the client table."""
        with self._lock:
            frame = None
            if self._dirty and self._folder.state is not None:
                frame = Frame(copy.deepcopy(self._folder.state), tuple(self._folder.recent), self._folder.acceptance)
                self._dirty = False
            clients, self._clients = self._clients, None
        if frame is not None:
            self._app.post_message(FrameReady(frame))
        if clients is not None:
            self._app.post_message(ClientsReady(clients))

    def step(self, *, if_idle: bool = False) -> None:
        raise Unsupported(f"{READ_ONLY}: it steps by itself")

    def back(self) -> None:
        raise Unsupported(f"{READ_ONLY}; to step back, record it (nanoserve serve --record) and replay the trace")

    def add_request(self, request_id: str, prompt: str, params: dict) -> None:
        raise Unsupported(f"{READ_ONLY}: send requests to {self.url}/v1 (curl, the openai client)")

    def abort(self, request_id: str) -> None:
        raise Unsupported(f"{READ_ONLY}: a request is aborted when its client disconnects")

    def fork(self, request_id: str) -> None:
        raise Unsupported(f"{READ_ONLY}: ask for n > 1 in the request to fork it")

    def branch(self, changes: dict) -> None:
        raise Unsupported(f"{READ_ONLY}; a branch replays a run on local weights: `nanoserve tui --scenario NAME`, "
                          "then w")

    def close(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:        # unblock the worker's read (an idle server sends only heartbeats)
            try:
                response.close()
            except Exception:  # noqa: BLE001 -- it is going away either way
                pass

    # -- worker thread -----------------------------------------------------------------

    def _listen(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        connected_once = False
        while not self._stop.is_set():
            try:
                with httpx.Client(timeout=httpx.Timeout(10.0, read=30.0), headers=headers) as client:
                    with client.stream("GET", f"{self.url}/events", params={"clients": 1}) as response:
                        if response.status_code != 200:
                            response.read()
                            raise ConnectionError(_http_error(response))
                        self._response = response
                        self._to_ui(self._app.post_message, SourceStatus("ready", f"attached to {self.url}"))
                        if not connected_once:
                            self._to_ui(self._app.notify, f"watching {self.url}: {READ_ONLY}", title="attached")
                        connected_once = True
                        self._read(response.iter_lines())
                        if not self._stop.is_set():
                            raise ConnectionError("the server ended the stream")
            except Exception as exc:  # noqa: BLE001 -- network errors, a closed stream, a bad line
                if self._stop.is_set():
                    return
                if not connected_once:
                    self._to_ui(self._app.post_message,
                                SourceStatus("error", f"could not attach to {self.url}: {exc}"))
                    return
                self._to_ui(self._app.notify, f"lost {self.url} ({exc}); reconnecting …", severity="warning")
            finally:
                self._response = None
            if self._stop.wait(RETRY_S):
                return

    def _read(self, lines: Iterable[str]) -> None:
        def until_stopped():                   # checked on every line, heartbeats included
            for line in lines:
                if self._stop.is_set():
                    return
                yield line

        for kind, data, event_id in sse_messages(until_stopped()):
            if kind == "clients":
                with self._lock:
                    self._clients = json.loads(data)
            elif kind == "lagging":
                raise ConnectionError("this view fell behind the server")
            elif kind == "message":
                event = event_from_dict(json.loads(data))
                with self._lock:
                    if self._folder.feed(event, batch_end=event_id is not None):
                        self._dirty = True

    def _to_ui(self, callback, *args, **kwargs) -> None:
        try:
            self._app.call_from_thread(callback, *args, **kwargs)
        except RuntimeError:   # the app is shutting down
            pass


def _http_error(response) -> str:
    if response.status_code == 401:
        return "the server wants an API key (--api-key, or $NANOSERVE_API_KEY)"
    try:
        return f"HTTP {response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"

