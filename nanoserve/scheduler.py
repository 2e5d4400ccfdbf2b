"""The scheduler: which sequences run this step, how many tokens each, with which blocks.

Continuous batching means the batch is rebuilt every step: finished requests
leave, new ones join, and one step is one model forward over a *mixed* batch.
`schedule()` fills a token budget (`max_num_batched_tokens`) in three passes:

1. **Decodes** of running sequences, in admission order: 1 token each.
2. **Prefill chunks** of running sequences that have not finished their
   prompt yet (chunked prefill: a long prompt spreads over several steps).
3. **Admission** of waiting sequences, first come first served, while the
   budget, `max_num_seqs` and the free blocks allow: each gets a chunk of its
   prompt (the whole prompt, if chunked prefill is off).

Before a sequence runs it must hold blocks for every token it will have KV
for. When a running sequence cannot get a block, the scheduler *preempts* the
most recently admitted sequence that is not already in this step's batch:
its blocks are freed and it goes back to the front of the waiting queue, to
recompute its KV (prompt + tokens generated so far) when there is room.
Waiting sequences are only admitted when free blocks cover their chunk; they
never preempt anyone. A sequence that could not fit even in an empty pool is
failed with an error instead of being retried forever.

The scheduler moves sequences between states and blocks between tables; the
engine runs the model, samples, and decides when a sequence is finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
from nanoserve.config import EngineConfig
from nanoserve.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    """Compute KV for tokens [start, start + num_tokens) of `seq` this step.

    With speculative decoding a decode chunk also carries draft tokens: it
    computes the last real token plus the drafts, num_tokens = 1 + len(drafts).
    """

    seq: Sequence
    start: int
    num_tokens: int
    is_prefill: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the sequence itself (not drafts) in this chunk."""
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's last token, so its logits give the next token?"""
        return self.start + self.num_real_tokens == self.seq.num_tokens

    def token_ids(self) -> list[int]:
        return self.seq.token_ids(self.start, self.start + self.num_real_tokens) + self.draft_token_ids


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)   # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)         # could never fit; finished with an error

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, emit: Callable[[ev.Event], None]) -> None:
        self.config = config
        self.pool = pool
        self.emit = emit                       # publishes an event (the engine stamps the step)
        self.step = 0                          # the engine's step counter, for event stamps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # in admission order: the last one is the first victim

    # -- queue changes from outside ---------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` (finished or aborted): drop it from its queue and free all its blocks at once."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        seq.set_status(status)
        self._free_blocks(seq)

    # -- the step ------------------------------------------------------------------

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Plan one step. `drafts` (speculative decoding) maps a decoding request to its draft tokens."""
        drafts = drafts or {}
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()   # request ids already in this step's batch (never preempted)

        # Pass 1 and 2: running sequences, decodes before unfinished prefills.
        decodes = [s for s in self.running if not s.is_prefilling]
        prefills = [s for s in self.running if s.is_prefilling]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop
                continue
            draft = drafts.get(seq.request_id, [])
            num_new = min(seq.num_uncomputed_tokens + len(draft), budget)
            draft = draft[: max(0, num_new - seq.num_uncomputed_tokens)]   # what the budget leaves room for
            if self._reserve(seq, num_new, scheduled, out):
                self._add_chunk(out, seq, num_new, scheduled, draft)
                budget -= num_new

        # Pass 3: admit waiting sequences (FCFS) while budget, seats and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.pool.blocks_needed(0, seq.num_tokens) > self.pool.num_blocks:
                self.waiting.popleft()
                self._fail(seq, out, f"needs {seq.num_tokens} tokens of KV but the whole pool holds "
                                     f"{self.pool.num_blocks * self.pool.block_size}")
                continue
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break                  # the whole prompt must wait for a step with room
                num_new = budget
            if self.pool.blocks_needed(0, seq.num_computed_tokens + num_new) > self.pool.num_free_blocks:
                break                      # admission only when the blocks are there
            self.waiting.popleft()
            seq.set_status(SequenceStatus.RUNNING)
            self.running.append(seq)
            self.emit(ev.RequestAdmitted(self.step, seq.request_id))
            self._allocate(seq, num_new)
            self._add_chunk(out, seq, num_new, scheduled)
            budget -= num_new
        return out

    def _reserve(self, seq: Sequence, num_new: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Get blocks for `num_new` more tokens of a running `seq`, preempting others if needed.

        Returns False when `seq` itself had to be preempted (or failed).
        """
        while self.pool.blocks_needed(len(seq.block_table), seq.num_computed_tokens + num_new) > self.pool.num_free_blocks:
            victim = next((s for s in reversed(self.running) if s.request_id not in scheduled), None)
            if victim is seq and self.pool.num_free_blocks + len(seq.block_table) == self.pool.num_blocks:
                # Nobody else holds a block and it still does not fit: it never will.
                self.running.remove(seq)
                self._fail(seq, out, f"needs more than the {self.pool.num_blocks} blocks of the pool")
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        self._allocate(seq, num_new)
        return True

    def _allocate(self, seq: Sequence, num_new: int) -> None:
        new_ids = self.pool.append_slots(seq.block_table, seq.num_computed_tokens + num_new)
        if new_ids:
            self.emit(ev.BlocksAllocated(self.step, seq.request_id, tuple(new_ids)))

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled: set[str],
                   draft: list[int] | None = None) -> None:
        start, draft = seq.num_computed_tokens, draft or []
        # A decode computes KV for the token sampled last step (plus any drafts after it);
        # anything else is (re)filling the prompt.
        is_decode = num_new - len(draft) == 1 and start == seq.num_tokens - 1 and seq.num_output_tokens > 0
        chunk = ScheduledChunk(seq, start, num_new, is_prefill=not is_decode, draft_token_ids=draft)
        out.chunks.append(chunk)
        scheduled.add(seq.request_id)
        self.emit(ev.ChunkScheduled(self.step, seq.request_id, chunk.start, num_new, chunk.is_prefill))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks, forget the KV, wait at the front of the queue."""
        lost = seq.num_computed_tokens
        self.running.remove(seq)
        seq.set_status(SequenceStatus.WAITING)
        self.emit(ev.Preempted(self.step, seq.request_id, "recompute", lost))
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _fail(self, seq: Sequence, out: SchedulerOutput, reason: str) -> None:
        seq.error = reason
        seq.set_status(SequenceStatus.FINISHED_ABORTED)
        self._free_blocks(seq)
        out.failed.append(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            released = self.pool.free(seq.block_table)
            self.emit(ev.BlocksFreed(self.step, seq.request_id, tuple(seq.block_table), tuple(released)))
            seq.block_table = []

    # -- after the forward pass ----------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        """The forward pass wrote KV for every scheduled chunk (drafts count once accepted)."""
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens += chunk.num_real_tokens

    def trim(self, seq: Sequence) -> tuple[int, ...]:
        """Free the blocks past the sequence's computed tokens (KV of rejected drafts)."""
        keep = self.pool.blocks_needed(0, seq.num_computed_tokens)
        extra = seq.block_table[keep:]
        if not extra:
            return ()
        released = self.pool.free(extra)
        del seq.block_table[keep:]
        self.emit(ev.BlocksFreed(self.step, seq.request_id, tuple(extra), tuple(released)))
        return tuple(extra)

    # -- inspection -----------------------------------------------------------------

    def check_invariants(self) -> None:
        tables = [s.block_table for s in self.running]
        self.pool.check_invariants(tables)
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq.request_id} in running but {seq.status.name}"
            expected = self.pool.blocks_needed(0, seq.num_computed_tokens)
            assert len(seq.block_table) == expected, (
                f"{seq.request_id}: {len(seq.block_table)} blocks for {seq.num_computed_tokens} computed tokens"
            )
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"{seq.request_id}: waiting with blocks"
        assert len(self.running) <= self.config.max_num_seqs
