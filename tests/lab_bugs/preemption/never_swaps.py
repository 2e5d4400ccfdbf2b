"""Bug: _preempt always recomputes, even with preemption_mode='swap'."""
from __future__ import annotations

from nanoserve import events as ev  # noqa: F401
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import Sequence, SequenceStatus  # noqa: F401

EXPECT_HINT = "is swapped out"


class Scheduler(_Scheduler):
    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Make room: swap `seq`'s KV to the CPU pool, or drop it to be recomputed later."""
        self.running.remove(seq)
        plan.preempted.append(seq)
        if False and seq.block_table and self.kv.can_swap_out(seq):
            seq.set_status(SequenceStatus.SWAPPED)
            self.emit(ev.Preempted(self.step, seq.seq_id, "swap", 0))
            self.kv.swap_out(seq)
            self.swapped.append(seq)
            return
        lost = seq.num_computed_tokens
        seq.set_status(SequenceStatus.WAITING)
        self.emit(ev.Preempted(self.step, seq.seq_id, "recompute", lost))
        self.kv.release(seq, cache_kv=True)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
