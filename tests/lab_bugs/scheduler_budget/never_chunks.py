"""Bug: _chunk_size returns 0 for any prompt longer than the budget, chunked prefill or not (it never runs)."""
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import SequenceStatus

EXPECT_HINT = "split into chunks"


class Scheduler(_Scheduler):
    def _chunk_size(self, seq, budget, num_cached=0):
        num_new = seq.num_tokens - max(num_cached, seq.num_computed_tokens)
        return 0 if num_new > budget else num_new
