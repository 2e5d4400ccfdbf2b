"""GET /events: the engine's events as server-sent events, one trace line each.

Every `data:` line is exactly a line of a JSONL trace (`trace.event_to_dict`),
so the stream is a trace being written:

    curl -sN http://127.0.0.1:8000/events | sed -un 's/^data: //p' > live.jsonl
    nanoserve tui --replay live.jsonl

A watcher subscribes to the engine's EventBus on the engine thread, between
two steps, so its first event is an EngineSynced of that moment and every
later event follows in order: folding the stream gives the engine's state
after every step (what `nanoserve tui --attach` draws). The engine thread
buffers a watcher's events and hands them over once per step, as one batch
(one thread hop per step, not per event). The last event of each batch
carries an SSE `id:` (the batch number): there the engine is between two
steps, so a viewer that folds up to an id never draws half a step.

A watcher that cannot keep up (its queue of batches is full) is told so
(`event: lagging`) and closed: dropping events would make its fold wrong;
reconnecting starts afresh from a new EngineSynced. With `?clients=1` the
stream also carries `event: clients` with the server's client table (see
`clients.py`), at most a few times a second; those are not trace lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from nanoserve.events import Event
from nanoserve.serve.clients import ClientBook
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.trace import event_to_dict

log = logging.getLogger("nanoserve.serve")
MAX_BATCHES = 2000        # steps a watcher may fall behind before it is closed
HEARTBEAT_S = 5.0         # an SSE comment this often keeps proxies from closing an idle stream
CLIENTS_EVERY_S = 0.25    # the clients table at most this often


class Watcher:
    """One /events connection: events buffered on the engine thread, batches awaited on the asyncio one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.batches: asyncio.Queue[list[str] | None] = asyncio.Queue(MAX_BATCHES)   # None: the end
        self.lagging = False
        self.closed = False
        self._buffer: list[Event] = []
        self.unsubscribe = None

    def on_event(self, event: Event) -> None:     # engine thread (an EventBus subscriber)
        self._buffer.append(event)

    def flush(self) -> None:                      # engine thread, after each step
        if not self._buffer:
            return
        lines = [json.dumps(event_to_dict(e), ensure_ascii=False) for e in self._buffer]
        self._buffer = []
        try:
            self._loop.call_soon_threadsafe(self._offer, lines)
        except RuntimeError:                      # the event loop is closed
            pass

    def close(self) -> None:                      # asyncio thread: the server is shutting down
        self.closed = True
        try:
            self.batches.put_nowait(None)         # wakes the stream at once
        except asyncio.QueueFull:                 # it is busy anyway: it sees `closed` at its next turn
            pass

    def _offer(self, lines: list[str]) -> None:   # asyncio thread
        if self.lagging or self.closed:
            return
        try:
            self.batches.put_nowait(lines)
        except asyncio.QueueFull:
            self.lagging = True


class EventHub:
    """The watchers of one server; subscribes and unsubscribes them on the engine thread."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop
        self.watchers: list[Watcher] = []        # engine thread only
        self.open: set[Watcher] = set()          # asyncio thread: streams to end at shutdown
        engine_loop.on_step(self._flush)

    def _flush(self) -> None:
        for w in list(self.watchers):
            try:
                w.flush()
            except Exception:  # noqa: BLE001 -- this watcher cannot be served: end its stream, not the others
                self.watchers.remove(w)
                if w.unsubscribe:
                    w.unsubscribe()
                log.warning("an /events watcher failed and was closed", exc_info=True)
                try:
                    w._loop.call_soon_threadsafe(w.close)
                except RuntimeError:              # the event loop is closed
                    pass

    async def watch(self) -> Watcher:
        w = Watcher(asyncio.get_running_loop())

        def subscribe(engine) -> None:
            self.watchers.append(w)
            w.unsubscribe = engine.subscribe(w.on_event)   # EngineSynced first, then everything
            w.flush()

        await asyncio.wrap_future(self.engine_loop.call(subscribe))
        self.open.add(w)
        return w

    def close_all(self) -> None:
        """End every /events stream (asyncio thread): a server cannot shut down while they run."""
        for w in list(self.open):
            w.close()

    def unwatch(self, w: Watcher) -> None:
        self.open.discard(w)

        def unsubscribe(engine) -> None:
            if w.unsubscribe:
                w.unsubscribe()
            if w in self.watchers:
                self.watchers.remove(w)

        self.engine_loop.call(unsubscribe)


async def event_stream(hub: EventHub, w: Watcher, book: ClientBook, client_key: int,
                       send_clients: bool = False) -> AsyncIterator[str]:
    """The SSE body of one watcher (`send_clients`: the clients table too). Ends the watch when closed."""
    sent_version, sent_at, last_write = -1, 0.0, time.monotonic()
    wait = CLIENTS_EVERY_S if send_clients else HEARTBEAT_S
    get: asyncio.Future | None = None      # one pending get, kept across timeouts: no batch is ever lost
    batch = 0
    try:
        while not w.closed:
            get = get or asyncio.ensure_future(w.batches.get())
            done, _ = await asyncio.wait({get}, timeout=wait)
            if done:
                lines, get = get.result(), None
                if lines is None or w.closed:      # the server is shutting down
                    return
                batch += 1             # the last event of a batch carries an id: a consistent point to draw
                yield "".join(f"data: {line}\n\n" for line in lines[:-1]) + f"id: {batch}\ndata: {lines[-1]}\n\n"
                last_write = time.monotonic()
            elif time.monotonic() - last_write >= HEARTBEAT_S:
                yield ": ping\n\n"
                last_write = time.monotonic()
            if w.lagging and w.batches.empty():
                yield "event: lagging\ndata: {\"reason\": \"this client fell too far behind; reconnect\"}\n\n"
                return
            now = time.monotonic()
            if send_clients and book.version != sent_version and now - sent_at >= CLIENTS_EVERY_S:
                sent_version, sent_at = book.version, now
                yield f"event: clients\ndata: {json.dumps(book.table(), ensure_ascii=False)}\n\n"
    finally:
        if get is not None:
            get.cancel()
        hub.unwatch(w)
        book.remove_watcher(client_key)
