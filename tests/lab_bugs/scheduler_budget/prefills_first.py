"""Bug: prefill chunks are scheduled before decodes, so a long prompt starves a streaming request."""
from nanoserve.scheduler import ScheduledChunk, SchedulerOutput  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import SequenceStatus

EXPECT_HINT = "schedule decodes first"


class Scheduler(_Scheduler):
    def _schedule_running(self, out, budget, drafts, scheduled):
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.is_prefilling]
        for seq in prefills + decodes:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            draft = drafts.get(seq.request_id, [])
            num_new = min(seq.num_uncomputed_tokens + len(draft), budget)
            draft = draft[: max(0, num_new - seq.num_uncomputed_tokens)]
            if self._reserve(seq, num_new, scheduled, out):
                self._add_chunk(out, seq, num_new, scheduled, draft)
                budget -= num_new
        return max(budget, 0)
