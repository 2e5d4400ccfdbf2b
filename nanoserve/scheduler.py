"""The scheduler: which sequences run this step, how many tokens each, with which blocks.

Continuous batching means the batch is rebuilt every step: finished requests
leave, new ones join, and one step is one model forward over a *mixed* batch.
`schedule()` fills a token budget (`max_num_batched_tokens`) in four passes:

1. **Decodes** of running sequences, in admission order: 1 token each.
2. **Prefill chunks** of running sequences that have not finished their
   prompt yet (chunked prefill: a long prompt spreads over several steps).
3. **Swap-in** of swapped sequences, oldest first, when their blocks fit
   (not in a step that had to preempt).
4. **Admission** of waiting sequences, first come first served, while the
   budget, `max_num_seqs` and the blocks allow (and nobody is swapped out:
   they were running first). A waiting sequence starts from its longest
   cached prefix (`prefix cache hit`): only the rest is computed.

Before a sequence runs it must hold blocks for every token it will have KV
for. When a running sequence cannot get a block, the scheduler *preempts* a
victim that is not already in this step's batch, chosen by
`preemption_policy`:

* "newest": the most recently admitted (the default: older requests keep going),
* "priority": the lowest `priority` (ties: the newest),
* "shortest_remaining": the one with the most tokens still to generate, so
  the ones closest to finishing run on and free their blocks soon.
  (Picking the opposite, the one closest to completion, would throw away
  the most nearly finished work, so nanoserve does not offer it.)

With `preemption_mode="recompute"` the victim's blocks are freed and it waits
at the front of the queue to recompute its KV; with "swap" its KV is copied to
the CPU pool and back later (falling back to recompute when the CPU pool is
full). Waiting sequences never preempt a sequence that is making progress.
A *stuck* beam makes none: a running beam that has its next-token scores and
waits, holding a seat and blocks, for a sibling that was preempted. Stuck
beams (of other requests) are the first victims, for running and waiting
sequences alike, or a beam search could hold its blocks while the others
preempt each other, or two beam searches wait on each other, forever. A sequence that could not fit
even in an empty pool is failed with an error instead of retried forever.

The scheduler moves sequences between queues; `kv_manager.py` does the block
work (allocation with eviction, prefix hits, copy-on-write, swap); the engine
runs the model, samples, and decides when a sequence is finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve import events as ev
from nanoserve.config import EngineConfig
from nanoserve.kv_manager import BlockMoves, KVManager
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
    # prompt log-probabilities this chunk's forward computed, for the entries after those the sequence has
    # (filled in the compute phase, appended at commit: prompt_logprobs.py)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)

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
class StepPlan:
    """What one step will do, as `schedule()` decided it: the engine's `plan` for the compute phase."""

    chunks: list[ScheduledChunk] = field(default_factory=list)   # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)         # could never fit; finished with an error
    moves: BlockMoves = field(default_factory=BlockMoves)         # KV copies for the runner (the KV manager
                                                                 # records them here as it decides them)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class Planning:
    """A step while `schedule()` builds it: the plan so far and the token budget it has left."""

    plan: StepPlan
    budget: int                                          # tokens left of max_num_batched_tokens
    drafts: dict[str, list[int]]                         # speculative decoding: sequence id -> draft tokens
    scheduled: set[str] = field(default_factory=set)     # sequence ids in this step's batch (never preempted)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, emit: Callable[[ev.Event], None],
                 clock: ev.StepClock | None = None) -> None:
        self.config = config
        self.kv = kv
        self.pool = kv.pool
        self.emit = emit                       # publishes an event
        self.clock = clock or kv.clock         # the engine's step number, for event stamps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # in admission order: the last one is the newest
        self.swapped: deque[Sequence] = deque()   # swapped out to the CPU pool, oldest first

    # -- queue changes from outside ---------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` (finished or aborted): drop it from its queue and free all its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        seq.set_status(status)
        self.kv.release(seq, cache_kv=True)

    @property
    def step(self) -> int:
        """The engine's step number (read from the shared clock; only the engine advances it)."""
        return self.clock.step

    @property
    def seats_used(self) -> int:
        return sum(s.seats for s in self.running)

    # -- the step ------------------------------------------------------------------

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> StepPlan:
        """Plan one step. `drafts` (speculative decoding) maps a decoding sequence to its draft tokens.

        The four passes of the module docstring, in order, share one `Planning`: the token budget
        left and what is already in the batch (a scheduled sequence is never preempted).
        """
        planning = Planning(StepPlan(), self.config.max_num_batched_tokens, drafts or {})
        self.kv.begin_step(planning.plan.moves)   # copy-on-write copies and swaps go into the plan
        self._schedule_running(planning)      # passes 1 and 2: decodes, then unfinished prefills
        self._swap_in(planning)               # pass 3
        self._admit(planning)                 # pass 4
        return planning.plan

    def _schedule_running(self, planning: Planning) -> None:
        """Passes 1 and 2: every running sequence's next chunk, decodes before unfinished prefills.

        A decode is 1 token (plus its drafts, as far as the budget goes); a prefill chunk is what the
        budget leaves. A beam that already has its next-token scores waits (0 tokens to compute)
        for the other beams. A sequence that cannot get its blocks preempts a victim (`_reserve`).
        """
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.is_prefilling]
        for seq in decodes + prefills:
            if planning.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop
                continue
            draft = planning.drafts.get(seq.seq_id, [])
            num_new = min(seq.num_uncomputed_tokens + len(draft), planning.budget)
            draft = draft[: max(0, num_new - seq.num_uncomputed_tokens)]   # what the budget leaves room for
            if self._reserve(seq, num_new, planning.scheduled, planning.plan):
                self._add_chunk(planning.plan, seq, num_new, planning.scheduled, draft)
                planning.budget -= num_new

    def _swap_in(self, planning: Planning) -> None:
        """Pass 3: swapped sequences come back, oldest first, while their blocks fit.

        They were running before anyone waiting, so they come first; but not in a step that just
        preempted: memory is short, and what came back would only be swapped out again (vLLM's
        scheduler waits the same way). One whose next token would not fit even in an empty pool
        is failed: it was swapped out at the pool's size (sharing its blocks with a fork), and
        waiting for it would stop every admission for good.
        """
        while self.swapped and planning.budget > 0 and not planning.plan.preempted:
            seq = self.swapped[0]
            if self.kv.blocks_for(seq.num_computed_tokens + min(1, seq.num_uncomputed_tokens),
                                  min(1, seq.num_uncomputed_tokens)) > self.pool.num_blocks:
                self.swapped.popleft()
                self._fail(seq, planning.plan, f"needs more than the {self.pool.num_blocks} blocks of the pool")
                continue
            num_new = self._chunk_size(seq, planning.budget)
            need = self.kv.blocks_to_swap_in(seq, num_new)
            if (not num_new and seq.num_uncomputed_tokens) or \
                    not self._make_room(seq, need, None, planning.scheduled, planning.plan):
                break
            self.swapped.remove(seq)      # (idle beams _make_room swapped out joined the queue's end)
            self.kv.swap_in(seq)
            seq.set_status(SequenceStatus.RUNNING)
            self.running.append(seq)
            if num_new:   # (a beam waiting for its siblings has nothing to compute)
                self.kv.grow(seq, num_new)
                self._add_chunk(planning.plan, seq, num_new, planning.scheduled)
                planning.budget -= num_new

    def _admit(self, planning: Planning) -> None:
        """Pass 4: admit waiting sequences, first come first served, while budget, seats and blocks last.

        Nobody is admitted while a sequence is swapped out (it was running first). A waiting
        sequence starts from its longest cached prefix, so only the rest is computed; one that
        could not fit even in an empty pool is failed instead of retried forever.
        """
        plan = planning.plan
        while self.waiting and planning.budget > 0 and not self.swapped:
            seq = self.waiting[0]
            if self.kv.blocks_for(seq.num_tokens, 1) > self.pool.num_blocks:
                self.waiting.popleft()
                self._fail(seq, plan, f"needs {seq.num_tokens} tokens of KV but the whole pool holds "
                                     f"{self.pool.num_blocks * self.pool.block_size}")
                continue
            if not self._make_room(seq, 0, None, planning.scheduled, plan):
                break                                  # no seat
            node, cached = self.kv.match(seq)          # the longest cached prefix (no blocks change yet)
            num_cached = len(cached) * self.pool.block_size
            num_new = self._chunk_size(seq, planning.budget, num_cached)
            if not num_new:
                break                                  # the whole prompt must wait for a step with room
            need = self.kv.blocks_for(num_cached + num_new, num_new, len(cached))
            if not self._make_room(seq, need, node, planning.scheduled, plan):
                break                                  # admission only when the blocks are there
            if plan.preempted and self.kv.radix is not None:   # preempted beams' blocks joined the cache:
                node, cached = self.kv.match(seq)            # match again (same or longer prefix)
                num_new = self._chunk_size(seq, planning.budget, len(cached) * self.pool.block_size)
            self.waiting.remove(seq)   # not popleft(): beams _make_room preempted went to the front
            seq.set_status(SequenceStatus.RUNNING)
            self.running.append(seq)
            self.emit(ev.SequenceAdmitted(self.step, seq.seq_id))
            self.kv.commit_match(seq, node, cached)
            self.kv.grow(seq, num_new)
            self._add_chunk(plan, seq, num_new, planning.scheduled)
            planning.budget -= num_new

    def _chunk_size(self, seq: Sequence, budget: int, num_cached: int = 0) -> int:
        """Tokens of `seq` to compute this step (0: it must wait for a step with more budget)."""
        num_new = seq.num_tokens - max(num_cached, seq.num_computed_tokens)
        if num_new > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return num_new

    def _make_room(self, seq: Sequence, need: int, node, scheduled: set[str], plan: StepPlan) -> bool:
        """Are there seats for `seq` and `need` blocks (beyond what admitting `node`'s path frees)?

        If not, preempt *stuck* beams, newest first: running beams that computed their scores and
        wait, holding seats and blocks, for a sibling that is not running (it was preempted
        because memory was short). Without this, two beam searches could wait on each other's
        seats forever. A beam of `seq`'s own request is never preempted for it (that would
        only swap which sibling waits), nor one whose siblings all run (it waits one step).
        """
        def short() -> bool:
            return (self.seats_used + seq.seats > self.config.max_num_seqs or
                    need > self.kv.num_available_blocks - self.kv.evictable_in_path(node))
        if not short():
            return True
        stuck = self._stuck_beams(scheduled, seq.request_id)
        while stuck and short():
            self._preempt(stuck.pop(), plan)
        return not short()

    def _stuck_beams(self, scheduled: set[str], other_than: str) -> list[Sequence]:
        """Running beams (of requests other than `other_than`) that have their scores and wait for a
        sibling that is not running: they hold seats and blocks and compute nothing. Oldest first."""
        waiting_for = {s.request_id for s in (*self.waiting, *self.swapped)} - {other_than}
        return [s for s in self.running if s.num_uncomputed_tokens == 0 and s.request_id in waiting_for
                and s.seq_id not in scheduled]

    def _reserve(self, seq: Sequence, num_new: int, scheduled: set[str], plan: StepPlan) -> bool:
        """Get blocks for `num_new` more tokens of a running `seq`, preempting others if needed.

        Returns False when `seq` itself had to be preempted (or failed).
        """
        while self.kv.blocks_to_write(seq, num_new) > self.kv.num_available_blocks:
            victim = self._victim(seq, scheduled)
            if victim is seq and self.pool.blocks_needed(0, seq.num_computed_tokens + num_new) > self.pool.num_blocks:
                # It would not fit even alone in the pool: it never will. (Otherwise it waits
                # for room like any victim; blocks it shares with a fork do not count against it.)
                self.running.remove(seq)
                self._fail(seq, plan, f"needs more than the {self.pool.num_blocks} blocks of the pool")
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.kv.grow(seq, num_new)
        return True

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
        return max(candidates, key=key)[1]

    def _add_chunk(self, plan: StepPlan, seq: Sequence, num_new: int, scheduled: set[str],
                   draft: list[int] | None = None) -> None:
        start, draft = seq.num_computed_tokens, draft or []
        # A decode computes KV for the token sampled last step (plus any drafts after it);
        # anything else is (re)filling the prompt.
        is_decode = num_new - len(draft) == 1 and start == seq.num_tokens - 1 and seq.num_output_tokens > 0
        chunk = ScheduledChunk(seq, start, num_new, is_prefill=not is_decode, draft_token_ids=draft)
        plan.chunks.append(chunk)
        scheduled.add(seq.seq_id)
        self.emit(ev.ChunkScheduled(self.step, seq.seq_id, chunk.start, num_new, chunk.is_prefill))

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
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def drop_kv(self, seq: Sequence) -> None:
        """A failed step left `seq`'s KV unwritten (its block copies never ran): send it back to
        the front of the queue to recompute, keeping nothing of that KV (not even in the cache)."""
        lost = seq.num_computed_tokens
        (self.running if seq.status is SequenceStatus.RUNNING else self.swapped).remove(seq)
        seq.set_status(SequenceStatus.WAITING)
        self.emit(ev.Preempted(self.step, seq.seq_id, "recompute", lost))
        self.kv.release(seq, cache_kv=False)   # (its KV was never written)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def _fail(self, seq: Sequence, plan: StepPlan, reason: str) -> None:
        seq.error = reason
        seq.set_status(SequenceStatus.FINISHED_ABORTED)
        self.kv.release(seq, cache_kv=True)
        plan.failed.append(seq)

    # -- after the forward pass ----------------------------------------------------

    def mark_computed(self, plan: StepPlan) -> None:
        """The forward pass wrote KV for every scheduled chunk (drafts count once accepted)."""
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_real_tokens

    def cache_blocks(self) -> None:
        """After a step: running sequences' newly filled blocks go into the prefix cache, then (KV cache
        groups) the blocks their windows passed go back."""
        for seq in self.running:
            self.kv.cache_full_blocks(seq)
            self.kv.slide(seq)

    # -- inspection -----------------------------------------------------------------

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.running, list(self.swapped))
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq.seq_id} in running but {seq.status.name}"
            expected = self.pool.blocks_needed(0, seq.num_computed_tokens)
            assert len(seq.block_table) == expected, (
                f"{seq.seq_id}: {len(seq.block_table)} blocks for {seq.num_computed_tokens} computed tokens"
            )
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.cache_node is None, \
                f"{seq.seq_id}: waiting with blocks"
        for seq in self.swapped:
            assert seq.status is SequenceStatus.SWAPPED, f"{seq.seq_id} in swapped but {seq.status.name}"
        assert self.seats_used <= self.config.max_num_seqs, f"{self.seats_used} seats > max_num_seqs"
