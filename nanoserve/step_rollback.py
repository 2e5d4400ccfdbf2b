"""Rolling back a step whose compute phase failed, so that the next step runs as if it never started.

A step plans (bookkeeping), computes (tensors and random draws) and commits
(bookkeeping again); see `engine.py`. When the compute phase raises — the
draft model's or the target's forward, a block copy, the token choice; an
out-of-memory error, a kernel bug, Ctrl-C — no token has been appended and
no `num_computed_tokens` has moved, so undoing the plan is short:

* every RNG the step could have drawn from goes back to its saved state, so a
  seeded request still produces the tokens it would have without the failure;
* the draft model's cache is dropped for every running request (it is only a
  cache: the next proposal recomputes it);
* each scheduled chunk gives back the blocks it got for tokens that were never
  computed (`KVManager.trim`, told to viewers by a `KVTrimmed` event);
* if the failure came before the runner finished the step's block copies and
  swaps, every sequence whose KV was to arrive in a copied or swapped block is
  sent back to recompute, keeping none of that KV (`Scheduler.drop_kv`).

What the plan did that is still true stays: preempted sequences stay
preempted, admitted ones stay admitted (with their prefix-cache hits), failed
ones stay failed. Those are states the scheduler produces every step, so
`check_invariants()` holds and viewers' folds still match the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable

from nanoserve import events as ev
from nanoserve.errors import EngineBroken, StepFailed
from nanoserve.kv_manager import KVManager
from nanoserve.scheduler import Scheduler, StepPlan
from nanoserve.sequence import SequenceStatus


class Rollback:
    """What a step's compute phase has done so far that a failure must undo: the saved state of every
    per-request RNG it may draw from, and whether the plan's block moves were carried out. Built at the
    start of a step with the parts an undo changes (the scheduler, the KV manager, the proposer), as the
    scheduler is built with the KV manager: it never sees the engine."""

    def __init__(self, scheduler: Scheduler, kv: KVManager, proposer, emit: Callable[[ev.Event], None],
                 clock: ev.StepClock) -> None:
        self.scheduler, self.kv, self.proposer, self.emit, self.clock = scheduler, kv, proposer, emit, clock
        self._saved: dict[int, tuple] = {}
        self.blocks_moved = False     # the engine sets it once the runner has done the copies and swaps
        self.save_rngs(scheduler.running)

    def save_rngs(self, seqs) -> None:
        for seq in seqs:
            if seq.generator is not None and id(seq) not in self._saved:
                self._saved[id(seq)] = (seq.generator, seq.generator.get_state())

    def restore_rngs(self) -> None:
        for generator, state in self._saved.values():
            generator.set_state(state)

    def undo(self, plan: StepPlan | None) -> list[str]:
        """Undo a failed compute phase (`plan` is None when proposing drafts failed); returns the
        ids of the sequences whose work was lost."""
        self.restore_rngs()
        scheduler = self.scheduler
        if self.proposer:
            for seq in scheduler.running:
                self.proposer.release(seq.seq_id)
        if plan is None:
            return [s.seq_id for s in scheduler.running]
        if not self.blocks_moved:
            device_dst = {dst for _, dst in plan.moves.copies} | {dst for _, dst in plan.moves.swap_in}
            cpu_dst = {dst for _, dst in plan.moves.swap_out}
            for seq in [s for s in scheduler.running if device_dst & _held(s.block_table, s.group_tables)] + \
                       [s for s in scheduler.swapped if cpu_dst & _held(s.cpu_block_table, s.cpu_group_tables)]:
                scheduler.drop_kv(seq)
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING:
                freed = self.kv.trim(seq)   # blocks past num_computed_tokens, which did not move
                self.emit(ev.KVTrimmed(self.clock.step, seq.seq_id, seq.num_computed_tokens,
                                       chunk.num_tokens, freed))
        return [c.seq.seq_id for c in plan.chunks]


def failure(step: int, exc: BaseException, plan: StepPlan | None, request_ids: list[str], result,
            blocks_moved: bool = True) -> BaseException:
    """The exception `step()` raises: a StepFailed naming the requests and the cause, or, for
    Ctrl-C and the like and for an `EngineBroken` (no next step will run), the original exception
    with the step's result attached."""
    if not isinstance(exc, Exception) or isinstance(exc, EngineBroken):   # Ctrl-C; a dead worker process
        exc.step_result = result
        return exc
    where = ("proposing drafts" if plan is None else
             "the block copies" if not blocks_moved else "the forward pass or the token choice")
    ids = ", ".join(request_ids) or "no request"
    return StepFailed(f"step {step}: {where} failed for {ids} ({type(exc).__name__}: {exc}); "
                      "nothing was computed: those requests keep their tokens and run again next step",
                      tuple(request_ids), result)


def _held(table: list[int], group_tables: list[list[int]]) -> set[int]:
    """The blocks of a sequence's table and of its KV cache groups' (kv_groups.py) tables."""
    return {*table, *(b for t in group_tables for b in t)}
