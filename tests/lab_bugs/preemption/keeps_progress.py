"""Bug: a recomputed victim keeps its num_computed_tokens, as if its KV were still there."""
from __future__ import annotations

from nanoserve import events as ev  # noqa: F401
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import Sequence, SequenceStatus  # noqa: F401

EXPECT_HINT = "set num_computed_tokens to 0"


class Scheduler(_Scheduler):
    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Make room: swap `seq`'s KV to the CPU pool, or drop it to be recomputed later."""
        self.running.remove(seq)
        plan.preempted.append(seq)
        if self.config.preemption_mode == "swap" and seq.block_table and self.kv.can_swap_out(seq):
            seq.set_status(SequenceStatus.SWAPPED)
            self.emit(ev.Preempted(self.step, seq.seq_id, "swap", 0))
            self.kv.swap_out(seq)
            self.swapped.append(seq)
            return
        lost = seq.num_computed_tokens
        seq.set_status(SequenceStatus.WAITING)
        self.emit(ev.Preempted(self.step, seq.seq_id, "recompute", lost))
        self.kv.release(seq, cache_kv=True)
        self.waiting.appendleft(seq)
