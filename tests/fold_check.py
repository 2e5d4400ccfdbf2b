"""`fold == snapshot`: what a viewer rebuilt from events must equal what the engine says it is.

The comparison itself is `nanoserve.engine_state.fold_mismatches` (also used by
`benchmarks/fuzz_engine.py`); this adds an assertion and a folding subscriber.
"""

from __future__ import annotations

from nanoserve.engine_state import fold_mismatches
from nanoserve.trace import ViewState


def assert_fold_matches(state: ViewState, snap: dict) -> None:
    problems = fold_mismatches(state, snap)
    assert not problems, "viewer fold != engine snapshot:\n  " + "\n  ".join(problems[:10])


class FoldWatcher:
    """A subscriber that folds every event, like a viewer: `watcher.check(engine)` compares."""

    def __init__(self, engine) -> None:
        from nanoserve.trace import fold

        self._fold = fold
        self.state = None
        self.unsubscribe = engine.subscribe(self)

    def __call__(self, event) -> None:
        self.state = self._fold(self.state, event)

    def check(self, engine) -> None:
        assert_fold_matches(self.state, engine.snapshot())
