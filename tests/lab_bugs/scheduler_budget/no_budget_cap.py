"""Bug: a chunk is not cut to the budget left: one long prompt blows the step's token budget."""
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import SequenceStatus

EXPECT_HINT = "cut every chunk to the budget"


class Scheduler(_Scheduler):
    def _schedule_running(self, planning):
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.is_prefilling]
        for seq in decodes + prefills:
            if planning.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            draft = planning.drafts.get(seq.seq_id, [])
            num_new = seq.num_uncomputed_tokens + len(draft)
            draft = draft[: max(0, num_new - seq.num_uncomputed_tokens)]
            if self._reserve(seq, num_new, planning.scheduled, planning.plan):
                self._add_chunk(planning.plan, seq, num_new, planning.scheduled, draft)
                planning.budget = max(planning.budget - num_new, 0)
