"""Bug: _victim preempts the OLDEST running request (min where max belongs)."""
from __future__ import annotations

from nanoserve import events as ev  # noqa: F401
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import Sequence, SequenceStatus  # noqa: F401

EXPECT_HINT = "NOT already in this step's batch"


class Scheduler(_Scheduler):
    def _victim(self, seq: Sequence, scheduled: set[str]) -> Sequence:
        """The running sequence to preempt for `seq`: a stuck beam of another request first (it
        makes no progress anyway), else one by `preemption_policy`; never one already in this batch."""
        stuck = self._stuck_beams(scheduled, seq.request_id)
        if stuck:
            return stuck[-1]
        candidates = [(i, s) for i, s in enumerate(self.running) if s.seq_id not in scheduled]
        policy = self.config.preemption_policy
        if policy == "priority":
            key = lambda c: (-c[1].priority, c[0])                                        # noqa: E731
        elif policy == "shortest_remaining":
            key = lambda c: (c[1].params.max_tokens - c[1].num_output_tokens, c[0])       # noqa: E731
        else:   # "newest"
            key = lambda c: c[0]                                                          # noqa: E731
        return min(candidates, key=key)[1]
