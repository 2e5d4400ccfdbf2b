"""Bug: _chunk_size cuts prompts to the budget even with chunked prefill switched off."""
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import SequenceStatus

EXPECT_HINT = "without chunked prefill a prompt runs whole"


class Scheduler(_Scheduler):
    def _chunk_size(self, seq, budget, num_cached=0):
        return min(seq.num_tokens - max(num_cached, seq.num_computed_tokens), budget)
