"""How the engine's objects show themselves in a REPL or a notebook, without importing the viewers.

Students type `engine.step()` at a prompt and get back objects that print as
rich panels. Drawing those panels is the viewers' job (`nanoserve/viz/`),
and the viewers sit above the engine: the engine never imports them. The
seam between the two is this module:

* an engine class that should display inherits `Displayable` (LLMEngine,
  BlockPool, RadixCache, RequestOutput, StepResult);
* a viewer registers how to draw it with `@renders(StepResult)` on a function
  that returns a rich renderable (`viz/repl.py` registers all five), or
  `@renders(LLMEngine, kind="svg")` for a picture Jupyter shows under it;
* the first time something is displayed, the modules named in `VIEWERS` are
  imported (so they can register) and the object's class, or its nearest
  base, is looked up.

`repr()` is the same panel rendered to text (coloured when the terminal
has colours); `_repr_html_` is the panel as HTML plus the SVG if there is one.
"""

from __future__ import annotations

import functools
import importlib
import io
import shutil
import sys
from typing import Any, Callable

from rich.console import Console

VIEWERS = ("nanoserve.viz.repl",)      # imported on first display; each registers its renderers

Renderer = Callable[[Any], Any]
_RENDERERS: dict[tuple[type, str], Renderer] = {}   # (class, "rich" | "svg") -> draw(obj)


def renders(cls: type, kind: str = "rich") -> Callable[[Renderer], Renderer]:
    """Decorator for a viewer: `@renders(BlockPool)` draws every BlockPool (and subclass) from now on."""
    def register(draw: Renderer) -> Renderer:
        _RENDERERS[(cls, kind)] = draw
        return draw
    return register


@functools.cache
def _load_viewers() -> None:
    for name in VIEWERS:
        importlib.import_module(name)


def renderer_for(obj: Any, kind: str = "rich") -> Renderer | None:
    """The registered drawing function for obj's class or its nearest base; None when none is registered."""
    _load_viewers()
    return next((_RENDERERS[(c, kind)] for c in type(obj).__mro__ if (c, kind) in _RENDERERS), None)


def as_text(renderable: Any) -> str:
    """A rich renderable as a string for repr(): the terminal's width (at most 120), colours if it has them."""
    buf = io.StringIO()
    width = min(shutil.get_terminal_size((100, 24)).columns, 120)
    Console(file=buf, width=width, force_terminal=sys.stdout.isatty(), color_system="auto").print(renderable)
    return buf.getvalue().rstrip("\n")


def as_html(renderable: Any) -> str:
    """A rich renderable as HTML with inline styles (Jupyter's _repr_html_)."""
    console = Console(record=True, width=110, file=io.StringIO())
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format='<pre style="font-family:monospace">{code}</pre>')


class Displayable:
    """Mixin: a rich panel in a REPL (`__rich__`, `repr`) and HTML/SVG in Jupyter, drawn by a registered viewer."""

    __slots__ = ()

    def __rich__(self) -> Any:
        draw = renderer_for(self)
        return draw(self) if draw else object.__repr__(self)

    def __repr__(self) -> str:
        return as_text(self.__rich__())

    def _repr_html_(self) -> str:
        return as_html(self.__rich__()) + (self._repr_svg_() or "")

    def _repr_svg_(self) -> str | None:
        draw = renderer_for(self, "svg")
        return draw(self) if draw else None
