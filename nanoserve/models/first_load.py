"""The first load of a GGUF model, made visible: what the one-time conversion is doing, and how far it is.

A GGUF file (SmolLM2's, or any `.gguf` path) is dequantised to float32 once
and cached as a Hugging Face folder (`resolve.py`). While that runs,
`converting()` draws tqdm bars on the terminal

    nanoserve: converting SmolLM2-135M-Instruct.Q4_1.gguf to float32, only the first time
    nanoserve: 515 MB to cache in ~/.cache/nanoserve/gguf
    reading the header and vocabulary … 00:35
    tensors: 100%|██████████| 272/272 [00:03<00:00, 73.76tensor/s]
    building the tokenizer, writing the float32 copy … 00:10
    nanoserve: converted in 50 s; later loads read the cache

(in a log, where bars would be noise, the first line ends `… done in 50 s`;
on failure the lines are taken back and the error is the only one)

and hands a `Conversion` to every listener (`listening(fn)`), about once a
second and after every tensor: the TUI's loading screen draws the same bar.
The conversion has three phases: reading the file's header (its settings and
the tokenizer's whole vocabulary, most of the time on SmolLM2), the tensors
one by one, then writing the float32 folder.

Two hooks into transformers, both undone at the end:

* transformers reads the tensors in one loop, `for tensor in tqdm(reader.tensors, ...)`
  in `transformers.modeling_gguf_pytorch_utils`; that module's `tqdm` is ours
  (`counted`), which passes every tensor through and counts it;
* transformers opens the file once for the config, once for the weights and
  twice for the tokenizer, and each `gguf.GGUFReader` parses the whole
  vocabulary again in Python; the reader is kept and handed back for the same
  path (read-only, memory-mapped), which halves the conversion's time.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

PHASES = ("reading", "tensors", "saving")


@dataclass(frozen=True, slots=True)
class Conversion:
    """How far the one-time conversion of a GGUF file is."""

    file: str               # the GGUF file's name
    folder: str             # the cache folder its float32 copy goes to
    phase: str              # "reading" (header and vocabulary), "tensors", "saving" (the float32 folder)
    done: int = 0           # tensors converted so far
    total: int = 0          # tensors in the file (0 until the tensors phase)
    elapsed_s: float = 0.0  # since the conversion started

    def line(self) -> str:
        """One line: `converting X to float32: tensors 120/272, 14 s (only the first time; cached in F)`."""
        what = {"reading": "reading its header and vocabulary",
                "tensors": f"tensors {self.done}/{self.total}",
                "saving": f"all {self.total} tensors done, building the tokenizer and writing the float32 copy"}[self.phase]
        return (f"converting {self.file} to float32: {what}, {self.elapsed_s:.0f} s "
                f"(only the first time; cached in {self.folder})")


_listeners: list[Callable[[Conversion], None]] = []
_lock = threading.Lock()


@contextlib.contextmanager
def listening(listener: Callable[[Conversion], None]) -> Iterator[None]:
    """Call `listener(conversion)` while this block runs (from the converting thread and a ticker thread)."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def short(folder: Path) -> str:
    """`~/.cache/nanoserve/gguf` rather than `/home/ada/.cache/nanoserve/gguf`."""
    try:
        return "~/" + str(folder.relative_to(Path.home()))
    except ValueError:
        return str(folder)


class _Progress:
    """The conversion's state, its tqdm bar (on a terminal) and its listeners."""

    def __init__(self, gguf: Path, folder: Path, stderr, on_terminal: bool) -> None:
        self.now = Conversion(gguf.name, short(folder), "reading")
        self.t0 = time.monotonic()
        self.stderr, self.on_terminal = stderr, on_terminal
        self.lines = 0                # bars finished and left on the terminal (taken back on failure)
        self.bar = self.status_bar("reading the header and vocabulary")

    def next_bar(self, make) -> None:
        """Close this bar (left on its line), then open the next (`make()`): never two open at once, or
        tqdm would stack the new one a line lower."""
        if not self.bar.disable:
            self.lines += 1
        self.bar.close()
        self.bar = make()

    def take_back(self) -> None:
        """On failure, on a terminal: the bars and the first two lines erased (the error is then the only line)."""
        self.bar.leave = False
        self.bar.close()
        if self.on_terminal:
            print("\033[F\033[K" * (self.lines + 2), end="", file=self.stderr, flush=True)

    def status_bar(self, text: str):
        """A bar without a total: the phase and the time it has taken so far."""
        from tqdm import tqdm

        return tqdm(total=None, desc=text, bar_format="{desc} … {elapsed}", file=self.stderr,
                    disable=not self.on_terminal, leave=True, mininterval=0.5)

    def tell(self, **changes) -> None:
        with _lock:
            self.now = Conversion(**{**{f: getattr(self.now, f) for f in Conversion.__slots__}, **changes,
                                     "elapsed_s": time.monotonic() - self.t0})
            listeners, now = list(_listeners), self.now
        for listener in listeners:
            listener(now)

    def counted(self, tensors, *args, **kwargs):
        """transformers' `tqdm(reader.tensors, desc=...)`: each tensor, counted."""
        from tqdm import tqdm

        tensors = list(tensors)
        self.next_bar(lambda: tqdm(total=len(tensors), desc="tensors", unit="tensor", file=self.stderr,
                                   disable=not self.on_terminal, leave=True, mininterval=0.5))
        self.tell(phase="tensors", total=len(tensors))
        for done, tensor in enumerate(tensors, 1):
            yield tensor
            self.bar.update(1)
            self.tell(done=done)
        self.next_bar(lambda: self.status_bar("building the tokenizer, writing the float32 copy"))
        self.tell(phase="saving")

    def tick(self, stop: threading.Event) -> None:
        """Once a second: the elapsed time moves, on the bar and for the listeners."""
        while not stop.wait(1.0):
            self.bar.refresh()
            self.tell()


@contextlib.contextmanager
def converting(gguf: Path, folder: Path, size_mb: int) -> Iterator[None]:
    """While a GGUF file converts: a tqdm bar on stderr (when no listener draws it), a `Conversion` for the
    listeners, and one parse of the file however often transformers opens it."""
    import gguf as gguf_package
    import transformers.modeling_gguf_pytorch_utils as gguf_reader

    stderr = sys.stderr               # the terminal, before transformers' own output is silenced
    with _lock:
        quiet = bool(_listeners)      # a listener (the TUI) draws it itself: nothing over its screen
    tty = not quiet and stderr.isatty()   # bars on a terminal; in a log, one line that ends "done in 42 s"
    if tty:                           # two short lines: a narrow terminal does not wrap them
        print(f"nanoserve: converting {gguf.name} to float32, only the first time\n"
              f"nanoserve: {size_mb} MB to cache in {short(folder)}", file=stderr, flush=True)
    elif not quiet:                   # a log: one line, finished with "done in" or "failed"
        print(f"nanoserve: converting {gguf.name} to float32, only the first time: {size_mb} MB cached in "
              f"{short(folder)} …", end="", file=stderr, flush=True)
    progress = _Progress(gguf, folder, stderr, tty)
    readers: dict[str, object] = {}
    new_reader = gguf_package.GGUFReader

    def reader(path, *args, **kwargs):
        key = str(Path(path).resolve())
        if args or kwargs or key not in readers:
            readers[key] = new_reader(path, *args, **kwargs)
        return readers[key]

    stop = threading.Event()
    ticker = threading.Thread(target=progress.tick, args=(stop,), daemon=True)
    saved = gguf_reader.tqdm, gguf_package.GGUFReader
    gguf_reader.tqdm, gguf_package.GGUFReader = progress.counted, reader
    progress.tell()
    ticker.start()
    try:
        yield
    except BaseException:
        stop.set()
        ticker.join()
        if tty:
            progress.take_back()
        elif not quiet:
            print(" failed", file=stderr, flush=True)
        raise
    finally:
        gguf_reader.tqdm, gguf_package.GGUFReader = saved
        stop.set()
        ticker.join()
        progress.bar.close()
    seconds = time.monotonic() - progress.t0
    if tty:
        print(f"nanoserve: converted in {seconds:.0f} s; later loads read the cache", file=stderr, flush=True)
    elif not quiet:
        print(f" done in {seconds:.0f} s", file=stderr, flush=True)
