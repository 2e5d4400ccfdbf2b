"""The serving page's architecture picture, drawn by `docs/img/make_serving_pictures.py`'s DOT.

That script (and tests/test_serve_docs.py) own what the picture says: every box
names the code it stands for. Here it is one more Graphviz picture: drawn with
its source's hash noted, so a change to the DOT or a hand edit is noticed. The
script's other picture, `tui-attach.svg`, is a live run with several clients
on threads; `python docs/generate.py` redraws it too (see `attach`), but no
run reproduces it byte for byte, so it is checked by test_serve_docs.py's
keywords, not here.
"""

from __future__ import annotations

import importlib.util

from docgen import DOCS, Result
from docgen.pictures import graphviz_svg


def pictures_script():
    spec = importlib.util.spec_from_file_location("make_serving_pictures", DOCS / "img" / "make_serving_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(read) -> Result:
    out = Result()
    out.files["docs/img/serve-architecture.svg"] = graphviz_svg(pictures_script().architecture_dot())
    return out


def attach() -> None:
    """Redraw the live `nanoserve tui --attach` screenshot (not compared: a live multi-client run)."""
    pictures_script().main("attach")
