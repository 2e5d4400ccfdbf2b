"""The engine loop: one thread owns the engine and steps it while there is work.

    HTTP handlers (asyncio thread)            engine loop (its own thread)
    ------------------------------            ----------------------------
    loop.submit(...)  -> a tokenizer thread: count the prompt's tokens, check the context
                      --- command queue --->  admit: check the waiting queue, engine.add_request
    await sink.get()  <-- call_soon_threadsafe --  after each engine.step(): the request's RequestOutput
    loop.abort(rid)   --- command queue --->  engine.abort_request (the client went away)
    loop.call(fn)     --- command queue --->  fn(engine) between two steps (/snapshot, /events subscribe)
    loop.tokenize(...) -> a tokenizer thread: POST /tokenize's text, never on the engine thread

Only this thread touches the engine, so the engine needs no locks: everything
else reaches it through the command queue, and the queue is drained between
steps, where the engine is consistent. Results go back to the asyncio thread
with `loop.call_soon_threadsafe`, the one thread-safe door asyncio has.

Why a thread and not a process. vLLM runs its engine core in a separate
process (ZeroMQ between them) so that Python work in the API server (HTTP,
JSON, detokenizing for thousands of clients) never holds the GIL the
scheduler needs. nanoserve serves a classroom, not thousands: a thread keeps
outputs and events as plain Python objects (no serialization), lets /events
subscribe to the very EventBus the TUI uses, and torch releases the GIL
inside the model's forward, which is where a step spends its time. The
price: heavy HTTP traffic slows the Python parts of a step. One more rule
for a thread that steps an engine: it should be the only thread that has
run OpenMP work (torch's CPU ops, the C kernels), or OpenMP's workers sleep
at every barrier; `nanoserve serve` builds the engine on a thread that ends
(`threads.on_a_thread_that_ends`) for that reason.

Back-pressure: a request is admitted only while the engine's waiting queue
holds fewer than `max_waiting` requests; past it the submit fails with HTTP 429
(checked here, at admission, so the count is exact). A request that
disconnects is aborted between two steps, which frees (or caches) its blocks.

Tokenizing a text prompt happens on a thread of its own (the tokenizers
library releases the GIL), in the order requests came, so they are admitted
first come, first served; a text prompt longer than LONG_PROMPT_CHARS goes to
two more threads beside it, so a huge prompt is counted and refused there
while everyone else is admitted and the engine keeps stepping. Only prompts
that fit the context reach the engine thread (where `add_request` tokenizes
them again, which is then bounded by the context length). Structured
output's grammars are compiled before the submit, on threads of their own
(`grammars.py`), so `add_request` finds them in xgrammar's cache; a
constraint that turns out unsatisfiable while decoding is the client's 400.

No request and no subscriber can stop this thread. A request whose admission
raises gets an error naming the cause; a step that fails (`StepFailed`: the
engine undid it) fails the requests it was computing, with the cause; a
subscriber that raises (a `--record` trace on a full disk) is logged and the
step's outputs go out as usual; a callback after a step that raises is logged.
Only an engine that cannot step again (`EngineBroken`, or a bug in the engine
itself) ends the loop, and then /health says so (503) and every waiting
client gets a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.engine import LLMEngine
from nanoserve.errors import StepFailed, SubscriberError
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.serve.metrics import ServerMetrics
from nanoserve.serve.protocol import ApiError

log = logging.getLogger("nanoserve.serve")
LONG_PROMPT_CHARS = 65_536   # text prompts longer than this are tokenized beside the others, not in line
LONG_PROMPT_THREADS = 2      # ... this many at once


class Sink:
    """The handler's end of one request: the engine thread puts, the handler awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop, constraint_field: str | None = None) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.constraint_field = constraint_field   # the request field asking for structured output, if any

    def put(self, item: RequestOutput | Exception) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:   # the event loop is closed: the server is shutting down
            pass

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass(slots=True)
class Submission:
    request_id: str
    prompt: str | list[int]             # text (chat: already through the chat template) or token ids
    params: dict                        # SamplingParams fields; max_tokens None = up to the context
    sink: Sink
    arrival: float = field(default_factory=time.monotonic)
    admitted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)   # -> prompt tokens
    num_prompt: int = 0                 # counted on a tokenizer thread before the engine sees it


class EngineLoop:
    """Owns `engine` on a thread of its own; see the module docstring."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, max_waiting: int = 64,
                 step_delay: float = 0.0) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        if step_delay < 0:
            raise ValueError(f"step_delay must be >= 0, got {step_delay}")
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting      # admitted requests that may wait for a seat; then 429
        self.step_delay = step_delay        # seconds to rest after each step (a classroom can follow)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._sinks: dict[str, Sink] = {}   # unfinished requests -> where their outputs go (engine thread only)
        self._after_step: list[Callable[[], None]] = []   # e.g. flush /events watchers (engine thread only)
        self._running = threading.Event()   # cleared: paused (commands still run, no steps)
        self._running.set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        # Prompts are counted off the engine thread, in the order they came (one thread: requests are
        # admitted first come, first served); long text prompts on threads of their own, so that one
        # huge prompt holds nobody up.
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(1, "nanoserve-tokenize")
        self._long_prompts = concurrent.futures.ThreadPoolExecutor(LONG_PROMPT_THREADS, "nanoserve-tokenize-long")
        self.error: str | None = None       # why the loop died, if it did
        self.failures = 0                   # errors survived: admissions, steps, subscribers, callbacks

    # -- from other threads --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._running.set()
        self._commands.put(lambda: None)    # wake the thread
        self._thread.join(timeout)
        for pool in (self._tokenizers, self._long_prompts):
            pool.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def pause(self) -> None:
        """Stop stepping (commands still run: requests are admitted and wait). For tests and teachers."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
        self._commands.put(lambda: None)

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between two steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:   # noqa: BLE001 -- handed to the caller
                future.set_exception(exc)

        self._commands.put(run)
        return future

    def tokenize(self, tokenizer, text: str, **kwargs) -> concurrent.futures.Future:
        """`text`'s token ids on a tokenizer thread, in line with the prompts (a long text beside
        them), never on the engine thread: POST /tokenize of a huge text holds no step up."""
        pool = self._long_prompts if len(text) > LONG_PROMPT_CHARS else self._tokenizers
        try:
            return pool.submit(lambda: list(tokenizer(text, **kwargs).input_ids))
        except RuntimeError:                # shut down: the server is stopping
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(ApiError(503, "the server is shutting down"))
            return future

    def submit(self, sub: Submission) -> concurrent.futures.Future:
        """Queue a request; the future gives its prompt token count, or raises ApiError (400, 429, 500, 503)."""
        if self.error is not None or not self.alive:
            sub.admitted.set_exception(ApiError(503, f"the engine loop is not running: {self.error or 'stopped'}"))
        else:
            long = isinstance(sub.prompt, str) and len(sub.prompt) > LONG_PROMPT_CHARS
            try:
                (self._long_prompts if long else self._tokenizers).submit(self._prepare, sub)
            except RuntimeError:            # shut down: the server is stopping
                sub.admitted.set_exception(ApiError(503, "the server is shutting down"))
        return sub.admitted

    def _prepare(self, sub: Submission) -> None:
        """A tokenizer thread: count the prompt's tokens, check them against the context, then queue it."""
        try:
            sub.num_prompt = self._count(sub)
        except ApiError as exc:
            sub.admitted.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 -- e.g. a tokenizer that refuses the text: this request only
            self._failed("preparing", sub.request_id, exc)
            sub.admitted.set_exception(ApiError(500, f"the server could not read this prompt: "
                                                     f"{type(exc).__name__}: {exc}", "prompt"))
            return
        self._commands.put(lambda: self._admit(sub))

    def abort(self, request_id: str) -> None:
        """The client is gone: stop its request (if it is still running) at the next chance."""
        self._commands.put(lambda: self._abort(request_id))

    def end_requests(self, message: str) -> None:
        """The server is shutting down and will not wait longer: every request still running gets a 503
        with `message` (a stream says so and ends with [DONE]; its handler then aborts it)."""
        self._commands.put(lambda: self._end_requests(message))

    def on_step(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the engine thread after every step and command batch."""
        self._after_step.append(callback)

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                idle = not self.engine.has_unfinished_requests() or not self._running.is_set()
                self._drain(block=idle)
                if self._stop or not self._running.is_set() or not self.engine.has_unfinished_requests():
                    if self.metrics:     # no step will refresh the gauges (e.g. after an abort): do it here
                        self.metrics.refresh(self.engine)
                    self._flush_watchers()
                    continue
                self._step()
                self._flush_watchers()
                if self.step_delay:
                    self._drain(block=True, timeout=self.step_delay, until_deadline=True)
        except Exception as exc:  # noqa: BLE001 -- the server reports it on /health
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("the engine loop died")
            for sink in self._sinks.values():
                sink.put(ApiError(500, f"the engine failed: {self.error}"))
            self._sinks.clear()

    def _drain(self, block: bool, timeout: float = 0.5, until_deadline: bool = False) -> None:
        """Run queued commands: when idle wait (up to `timeout`) for the first one, then take all
        that are there; `until_deadline` keeps taking them until the timeout is over (--step-delay)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                wait = max(0.0, deadline - time.monotonic())
                command = self._commands.get(timeout=wait) if block and wait else self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception as exc:  # noqa: BLE001 -- the commands answer their callers; this is a backstop
                self._failed("a command", "", exc)
            block = until_deadline and not self._stop   # else: only what is already queued

    def _step(self) -> None:
        try:
            result = self.engine.step()
        except SubscriberError as exc:       # the step completed; a subscriber (a viewer, --record) failed
            self._failed("a subscriber", "", exc)
            result = exc.result
        except StepFailed as exc:            # the engine undid the step: fail the requests it computed
            self._failed("a step", ", ".join(exc.request_ids), exc)
            result = exc.result
            self._fail_requests(exc)
        now = time.monotonic()
        for out in result.outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            error = next((c.error for c in out.outputs if c.error), None)
            sink.put(_gave_up(error, sink.constraint_field) if error else out)
            if out.finished:
                del self._sinks[out.request_id]
        if self.metrics:
            try:
                self.metrics.after_step(self.engine, result, now)
            except Exception as exc:  # noqa: BLE001 -- counting must not stop serving
                self._failed("the metrics", "", exc)

    def _fail_requests(self, exc: StepFailed) -> None:
        """After a StepFailed: abort the requests it names; their clients get the cause."""
        cause = exc.__cause__ or exc
        request_ids = {self.engine.sequences[s].request_id for s in exc.request_ids if s in self.engine.sequences}
        for rid in sorted(request_ids):
            sink = self._sinks.pop(rid, None)
            self._engine_abort(rid)
            if sink is not None:
                sink.put(ApiError(500, f"the engine could not compute a step with this request "
                                       f"({type(cause).__name__}: {cause}); it was stopped"))

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except SubscriberError as exc:       # aborted; a subscriber failed on its events
            self._failed("a subscriber", request_id, exc)
        if self.metrics:
            self.metrics.aborted(request_id)

    def _failed(self, stage: str, request_id: str, exc: BaseException) -> None:
        """Something went wrong and the loop goes on: say so in the log."""
        self.failures += 1
        log.warning("%s failed%s: %s: %s (the engine loop goes on)", stage,
                    f" ({request_id})" if request_id else "", type(exc).__name__, exc)

    def _flush_watchers(self) -> None:
        for callback in self._after_step:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 -- a watcher's problem is its own
                self._failed("a callback after the step", "", exc)

    def _admit(self, sub: Submission) -> None:
        """Check and add one request (engine thread); answer its `admitted` future."""
        try:
            self._add(sub)
        except ApiError as exc:
            if exc.status == 429 and self.metrics:
                self.metrics.rejected_request()
            sub.admitted.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 -- this request fails, with the cause; the loop goes on
            self._failed("admitting", sub.request_id, exc)
            if sub.request_id in self.engine.requests:   # (added, then something after it raised)
                self._engine_abort(sub.request_id)
            sub.admitted.set_exception(ApiError(500, f"the server could not admit this request: "
                                                     f"{type(exc).__name__}: {exc}"))
            return
        self._sinks[sub.request_id] = sub.sink
        if self.metrics:
            self.metrics.admitted(sub.request_id, sub.arrival, sub.num_prompt)
        sub.admitted.set_result(sub.num_prompt)

    def _count(self, sub: Submission) -> int:
        """The prompt's tokens, and the context check (a tokenizer thread: reads only the config and
        the tokenizer). Sets the submission's max_tokens when it asked for "up to the context"."""
        engine = self.engine
        if isinstance(sub.prompt, str):
            if engine.tokenizer is None:
                raise ApiError(400, f"model {engine.config.model!r} has no tokenizer: send the prompt as token ids",
                               "prompt")
            # counted here to check the context (add_request tokenizes again: the engine keeps the text,
            # which the TUI and the trace show, so it must get the prompt as text)
            num_prompt = len(engine.tokenizer(sub.prompt).input_ids)
        else:
            num_prompt = len(sub.prompt)
        context = engine.config.max_model_len
        if num_prompt >= context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{num_prompt}, which leaves no room to generate", "prompt", "context_length_exceeded")
        params = dict(sub.params)
        if params.get("max_tokens") is None:
            params["max_tokens"] = context - num_prompt
        elif num_prompt + params["max_tokens"] > context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; you asked for "
                                f"{num_prompt + params['max_tokens']} ({num_prompt} in the prompt, "
                                f"{params['max_tokens']} to generate)", "max_tokens", "context_length_exceeded")
        sub.params = params
        return num_prompt

    def _add(self, sub: Submission) -> None:
        """The engine thread: the waiting queue's bound (exact here), then add_request."""
        engine = self.engine
        waiting = len(engine.scheduler.waiting)
        if waiting >= self.max_waiting:
            raise ApiError(429, f"the server is busy: {waiting} requests are already waiting "
                                f"(--max-waiting {self.max_waiting}); retry later", code="queue_full")
        try:
            engine.add_request(sub.request_id, sub.prompt, SamplingParams(**sub.params), arrival_time=sub.arrival)
        except SubscriberError as exc:      # added; a subscriber failed on its RequestAdded
            self._failed("a subscriber", sub.request_id, exc)
        except ValueError as exc:
            field_name = getattr(exc, "field", None) or _guess_field(str(exc))
            raise ApiError(400, str(exc), field_name) from None

    def _end_requests(self, message: str) -> None:
        for sink in set(self._sinks.values()):     # (a batch's prompts share one sink: one error each)
            sink.put(ApiError(503, message))

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        if request_id in self.engine.requests:       # not finished in the meantime
            self._engine_abort(request_id)


def _gave_up(error: str, constraint_field: str | None) -> ApiError:
    """The error for a request the engine ended: a constraint that cannot go on is the client's (400,
    naming its field: found only while decoding, e.g. a choice shorter than min_tokens), else a 500."""
    if constraint_field is not None and "structured output:" in error:
        return ApiError(400, f"{constraint_field} cannot be satisfied: {error.split('structured output: ', 1)[1]}",
                        constraint_field)
    return ApiError(500, f"the engine gave up on this request: {error}")


def _guess_field(message: str) -> str | None:
    """The request field an engine ValueError is about ("n=9 sequences ..." -> "n")."""
    for name in ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "min_tokens", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt"):
        if message.startswith((f"{name} ", f"{name}=", f"{name}:")) or f" {name}=" in message[:40]:
            return name
    return "prompt" if "prompt" in message or "token ids" in message else None
