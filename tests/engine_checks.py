"""Checks shared by the hardening tests and the state machine.

`fold == snapshot`: what a viewer rebuilt from events must equal what the engine
says it is. The comparison itself is `nanoserve.engine_state.fold_mismatches`;
this adds an assertion, a folding subscriber (`FoldWatcher`), and `drive`, which
steps an engine to the end checking invariants, the fold and the seats after
every step.
"""

from __future__ import annotations

from nanoserve import SamplingParams
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


def greedy(n=8, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def drive(engine, watcher=None, max_steps=2000, seats=None) -> dict:
    """Step to the end, checking invariants, fold == snapshot and seats after every step."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        if watcher:
            watcher.check(engine)
        assert engine.scheduler.seats_used <= engine.config.max_num_seqs
    assert not engine.has_unfinished_requests(), "engine did not drain"
    return finished


def tokens(finished: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in finished.items()}
