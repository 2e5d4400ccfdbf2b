"""Worker processes and the process group they share: start, watch, stop.

    group = WorkerGroup.start(2, tp_worker.main, what="tensor-parallel worker")
    group.comm.broadcast_object(...)      # the driver is rank 0 of the group
    group.shutdown()

The driver (the process that called `start`) is rank 0; ranks 1..N-1 are
new processes started with torch.multiprocessing's "spawn" method (a fresh
interpreter: no copy of the driver's threads, locks or CUDA state, the only
start method that works everywhere). Each worker runs `target(comm, *args)`
and joins a gloo process group over 127.0.0.1.

Nothing listens beyond this machine. The driver's rendezvous store (a
`TCPStore`) would listen on every interface (`[::]`, dual-stack) whatever host
it is given, so the driver binds the socket itself, to 127.0.0.1, and hands it
over (`loopback_store`); each rank's gloo device binds 127.0.0.1 too. That
matters because nothing on these sockets is authenticated and what crosses
between ranks includes pickles, which run code when loaded:

* the store: each worker's "joined/<rank>" key (its pid), and gloo's own
  rendezvous keys (the ranks' loopback addresses);
* the gloo group: tensors (the batch's hidden states in all-reduces, logit
  shards in gathers) and Python objects as pickles (`comm.py`: the step's
  batch metadata, block moves, the ranks' pool reports and invariant checks;
  with disaggregation, a request's KV and its bookkeeping).

Only processes of this machine can connect, and only the driver starts them.

Everything is bounded in time:

* start-up: a worker that has not joined within `start_timeout` seconds, or
  that dies on the way, makes `start` raise `WorkerDied` (and stops the rest);
* every collective: the process group's timeout (`op_timeout`), so a worker
  that hangs is an error after that long, not a hang;
* a worker that *dies* closes its sockets; gloo sees that at once, and the
  driver's next collective raises. `failure()` turns that into a
  `WorkerDied` that names the rank, its pid and how it ended, and stops the
  other workers;
* no orphans: the driver stops every worker in `shutdown()` (also when it is
  garbage collected, and at interpreter exit: the processes are daemons), and
  each worker watches its parent and exits as soon as the driver is gone
  (`watch_parent`), even when the driver was killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.distributed.comm import Communicator
from nanoserve.errors import EngineBroken

START_TIMEOUT_S = 180.0   # spawn + import torch and transformers: ~6 s alone, much more on a busy machine
OP_TIMEOUT_S = 60.0       # the longest any one collective may wait for a rank
STOP_TIMEOUT_S = 5.0      # a worker told to stop gets this long before it is killed


class WorkerDied(EngineBroken):
    """A worker process of a distributed engine is gone (or never came up); the engine cannot go on."""


def loopback_store(world_size: int):
    """The driver's rendezvous store, listening on 127.0.0.1 only; returns (store, port).

    TCPStore binds every interface when it makes its own socket; given a socket that is
    already bound and listening (`master_listen_fd`), it serves on that one. The OS picks
    the port, so nothing can take it between choosing and binding."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=OP_TIMEOUT_S), wait_for_workers=False,
                          master_listen_fd=sock.detach())   # (the store owns the socket from here)
    return store, port


def gloo_group(store, rank: int, world_size: int) -> Communicator:
    """A gloo process group over 127.0.0.1 (never another interface), as a Communicator."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=OP_TIMEOUT_S)
    return Communicator(dist.ProcessGroupGloo(store, rank, world_size, opts), rank, world_size)


def join(rank: int, world_size: int, port: int) -> Communicator:
    """In a worker: say so in the driver's rendezvous store, then join the gloo group."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=OP_TIMEOUT_S))
    store.set(f"joined/{rank}", str(os.getpid()))
    return gloo_group(store, rank, world_size)


def watch_parent(parent_pid: int, interval: float = 0.5) -> None:
    """In a worker: exit at once when the driver is gone (its pid is no longer our parent)."""
    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                os._exit(3)
    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _worker_entry(rank: int, world_size: int, port: int, parent_pid: int, errors, target, args) -> None:
    """The first function a worker runs (in the new interpreter)."""
    watch_parent(parent_pid)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    try:
        target(join(rank, world_size, port), *args)
    except BaseException as exc:   # noqa: BLE001 -- report any failure to the driver, then exit non-zero
        try:
            errors.send(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        except Exception:          # noqa: BLE001 -- the driver may be gone too
            pass
        os._exit(1)
    os._exit(0)


def _stop(processes: list) -> None:
    """Join each worker for a moment, then terminate, then kill: nobody is left behind."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


class WorkerGroup:
    """Ranks 1..N-1 as processes, and the driver's end (rank 0) of their process group."""

    def __init__(self, processes: list, errors: list, comm: Communicator, store, what: str) -> None:
        self.processes = processes        # worker of rank r is processes[r - 1]
        self._errors = errors             # read ends of one pipe per worker (its last words)
        self.comm = comm
        self._store = store               # keeps the rendezvous server alive as long as the group
        self.what = what                  # "tensor-parallel worker", "prefill engine", ...
        self.error: WorkerDied | None = None   # set once the group is broken; every later call raises it
        self.owner = None                 # the runner using the group now (one at a time)
        self._finalizer = weakref.finalize(self, _stop, processes)

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self.processes]

    @classmethod
    def start(cls, world_size: int, target, args: tuple = (), what: str = "worker",
              start_timeout: float = START_TIMEOUT_S) -> WorkerGroup:
        """Spawn ranks 1..world_size-1 running `target(comm, *args)`; return once all have joined."""
        ctx = mp.get_context("spawn")
        store, port = loopback_store(world_size)   # first: the workers connect to it as they start
        processes, errors = [], []
        for rank in range(1, world_size):
            read, write = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_entry, args=(rank, world_size, port, os.getpid(), write, target, args),
                            name=f"nanoserve-{what.replace(' ', '-')}-{rank}", daemon=True)
            p.start()
            write.close()
            processes.append(p)
            errors.append(read)
        try:
            comm = _host(store, world_size, processes, errors, what, start_timeout)
        except BaseException:
            _stop(processes)
            raise
        return cls(processes, errors, comm, store, what)

    # -- failures -------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the group's WorkerDied if it is broken, or if a worker has exited since."""
        if self.error is not None:
            raise self.error
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise self.failure(None)

    def failure(self, exc: BaseException | None) -> WorkerDied:
        """What went wrong, as one WorkerDied naming the rank(s); stops every worker (no orphans)."""
        if self.error is not None:
            return self.error
        deadline = time.monotonic() + 2.0    # a dying worker needs a moment to be reaped
        while time.monotonic() < deadline and all(p.is_alive() for p in self.processes):
            time.sleep(0.02)
        dead = [(rank, p) for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]
        if dead:
            parts = []
            for rank, p in dead:
                last = _last_words(self._errors[rank - 1])
                parts.append(f"{self.what} rank {rank} (pid {p.pid}) {_how(p.exitcode)}"
                             + (f": {last.splitlines()[0]}" if last else ""))
            text = "; ".join(parts)
        else:
            text = f"a {self.what} stopped answering ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        self.error = WorkerDied(f"{text}. The distributed engine cannot continue; its other processes "
                                "were stopped. Start a new engine.")
        self.shutdown()
        return self.error

    def shutdown(self) -> None:
        """Stop every worker (the caller has told them to stop, or they are stuck): join, terminate, kill."""
        _stop(self.processes)
        for r in self._errors:
            r.close()
        self._errors = []
        if self.error is None:
            self.error = WorkerDied(f"this {self.what} group was shut down")

    @property
    def alive(self) -> bool:
        return self.error is None

    @contextlib.contextmanager
    def guard(self):
        """Around every group operation: a broken group raises its error at once, and any failure
        inside (gloo's "connection closed", a timeout) becomes the WorkerDied that says why."""
        self.check()
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, WorkerDied):
                raise
            raise self.failure(exc) from exc


def _host(tcp, world_size, processes, errors, what, timeout) -> Communicator:
    """Wait until every worker joined the rendezvous in `tcp` (WorkerDied if one dies or time runs out),
    then join the gloo group as rank 0."""
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(processes, start=1):
        while not tcp.check([f"joined/{rank}"]):
            time.sleep(0.05)
            if not p.is_alive():
                last = _last_words(errors[rank - 1])
                raise WorkerDied(f"{what} rank {rank} (pid {p.pid}) {_how(p.exitcode)} while starting"
                                 + (f": {last}" if last else ""))
            if time.monotonic() > deadline:
                raise WorkerDied(f"{what} rank {rank} did not start within {timeout:.0f} s")
    return gloo_group(tcp, 0, world_size)


def _last_words(conn) -> str:
    """The error text a worker sent before exiting, if any."""
    try:
        if conn.poll(0.2):
            return conn.recv()
    except (EOFError, OSError):
        pass
    return ""


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
