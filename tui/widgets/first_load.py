"""The loading screen's bar for a model's first load: its GGUF file converted to float32, tensor by tensor.

Shown only while a conversion runs (`nanoserve/models/first_load.py` reports
each tensor); a later load reads the cached copy and never shows it.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static

from nanoserve.models.first_load import Conversion


class FirstLoad(Vertical):
    """`converting X to float32: 120/272 tensors (only the first time; cached in F)` and a bar."""

    def compose(self) -> ComposeResult:
        yield Static(id="first-load-text")
        yield ProgressBar(id="first-load-bar", show_eta=False)

    def show(self, conversion: Conversion) -> None:
        self.display = True
        self.query_one("#first-load-text", Static).update(conversion.line())
        bar = self.query_one(ProgressBar)
        bar.update(total=conversion.total or None, progress=conversion.done)
