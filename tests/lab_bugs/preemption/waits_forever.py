"""Bug: when the only victim is the sequence itself, _reserve skips it this step and hopes for room later."""
from __future__ import annotations

from nanoserve import events as ev  # noqa: F401
from nanoserve.scheduler import ScheduledChunk, StepPlan  # noqa: F401
from nanoserve.scheduler import Scheduler as _Scheduler
from nanoserve.sequence import Sequence, SequenceStatus  # noqa: F401

EXPECT_HINT = "livelocks the scheduler"


class Scheduler(_Scheduler):
    def _reserve(self, seq: Sequence, num_new: int, scheduled: set[str], plan: StepPlan) -> bool:
        """Get blocks for `num_new` more tokens of a running `seq`, preempting others if needed.

        Returns False when `seq` itself had to be preempted (or failed).
        """
        while self.kv.blocks_to_write(seq, num_new) > self.kv.num_available_blocks:
            victim = self._victim(seq, scheduled)
            if victim is seq and self.pool.blocks_needed(0, seq.num_computed_tokens + num_new) > self.pool.num_blocks:
                return False                      # the bug: nothing frees room for it, ever
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.kv.grow(seq, num_new)
        return True
