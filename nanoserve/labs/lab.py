"""What a lab is: one component to write, a starter, and checks that judge it on the real engine.

A `Lab` names the engine module a student rewrites (`module`), the functions
whose bodies the starter leaves empty (`blanks`, with a TODO for each, and a
`contracts` text for the design-mode starter), how the student's module plugs
into the engine (`components`: module -> `Components`), its `checks`, and the
`why` questions `lab check` asks once everything passes.

A `Check` is a function of a `Context` that raises `CheckFailed` (or lets an
assertion or an exception escape) when the student's code is wrong; its
`hint` says in plain words what to look at. A check that knows *which* bug
it saw raises `CheckFailed` with a sharper hint of its own. A check that
judges one function names it (`function`, and its name starts with it), and
the checks run helpers first: the first failing row names the function at fault.

The checks run in the checker's process; `ctx.module` is the student's module
in the worker (a `remote.Proxy`, used like the module itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class CheckFailed(AssertionError):
    """A check saw wrong behaviour: `str(self)` says what, `hint` (optional) names the likely bug."""

    def __init__(self, what: str, hint: str | None = None) -> None:
        super().__init__(what)
        self.hint = hint


def expect(cond: bool, what: str, hint: str | None = None) -> None:
    """Raise CheckFailed(what, hint) unless `cond`."""
    if not cond:
        raise CheckFailed(what, hint)


def raises(error: type[Exception], call: Callable[[], Any], what: str, hint: str | None = None) -> None:
    """`call()` must raise `error` (a stated rule: e.g. ValueError for an id outside the pool).

    Another exception type, or none, is a CheckFailed saying which. (The time limit's and the
    channel's exceptions are BaseExceptions: they pass through.)"""
    try:
        call()
    except error:
        return
    except Exception as exc:   # noqa: BLE001 -- the wrong type is the finding
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise CheckFailed(f"{what} raised {text}; expected {error.__name__}", hint) from None
    raise CheckFailed(f"{what} did not raise {error.__name__}", hint)


@dataclass(frozen=True, slots=True)
class Check:
    """One auto-checked property of the student's component."""

    name: str                                  # a short line for the results table
    run: Callable[[Context], None]             # raises when the property does not hold
    hint: str                                  # what to look at when it fails, in plain words
    time_limit_s: float = 60.0                 # a check still running after this is stopped and reported
    function: str = ""                         # the blank it judges ("": the whole component)

    def __post_init__(self) -> None:
        if not self.name or not self.hint:
            raise ValueError("a check needs a name and a hint")
        if self.time_limit_s <= 0:
            raise ValueError(f"check {self.name!r}: time_limit_s must be positive")
        if self.function and not self.name.startswith(self.function):
            raise ValueError(f"check {self.name!r} judges {self.function}: its name must start with it")


@dataclass(frozen=True, slots=True)
class Lab:
    """One exercise: which engine module the student rewrites, and how it is judged."""

    name: str                                  # the CLI name, e.g. "block-pool"
    title: str                                 # one line: what you implement
    module: str                                # the engine module the starter is made from
    blanks: dict[str, str]                     # qualname -> TODO text; these bodies are the exercise
    components: Callable[[Any], Any]           # student module -> the Components the engine is built with
    checks: tuple[Check, ...]
    prerequisites: str = "Python, and the lesson on this mechanism"
    minutes: int = 45                          # rough time for a student
    keep: tuple[str, ...] | None = None        # top-level names the starter keeps (None: the whole module)
    starter_name: str = ""                     # the starter's file name (default: the module's)
    intro: str = ""                            # a few lines for the starter's header and README
    contracts: dict[str, str] = field(default_factory=dict)   # qualname -> the rules it keeps (design mode)
    invariants: str = ""                       # what must hold between calls (the design-mode header)
    why: tuple[tuple[str, str], ...] = ()      # (question, answer): asked when every check passes
    worker_imports: tuple[str, ...] = ()       # modules the worker imports before the student's file

    def __post_init__(self) -> None:
        if not self.blanks or not self.checks:
            raise ValueError(f"lab {self.name!r} needs blanks and checks")
        names = [c.name for c in self.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"lab {self.name!r}: check names repeat")
        stray = {c.function for c in self.checks if c.function} - set(self.blanks)
        if stray:
            raise ValueError(f"lab {self.name!r}: checks judge {sorted(stray)}, which are not blanks")
        if set(self.contracts) - set(self.blanks):
            raise ValueError(f"lab {self.name!r}: contracts for functions that are not blanks")

    @property
    def file_name(self) -> str:
        return self.starter_name or self.module.rsplit(".", 1)[-1] + ".py"


@dataclass(slots=True)
class Context:
    """What a check gets: the student's module, and engines built with it (one model load per process)."""

    lab: Lab
    module: Any                                # the student's module (a handle to it in the worker)
    path: str                                  # its path, for messages
    _loaded: dict = field(default_factory=dict)  # model name -> LoadedModel, shared by the checks
    helper: Callable[..., Any] | None = None   # helper("module:function", *args): run a lab helper in the worker

    def loaded(self, model: str = "tiny-llama"):
        """The model's weights, loaded once (engines share them, as tests do)."""
        if model not in self._loaded:
            import torch

            from nanoserve.models.loader import load_model
            self._loaded[model] = load_model(model, torch.float32, "cpu", 0)
        return self._loaded[model]

    def components(self):
        return self.lab.components(self.module)
