"""Known bugs of the preemption lab (nanoserve/scheduler.py, as scheduler_preemption.py), and its equivalent
mutants. See make.py."""

from make import Bug

BUGS = (
    Bug("oldest_victim", "Scheduler._victim", "_victim preempts the OLDEST running request (min where max belongs)",
        (("return max(candidates, key=key)[1]", "return min(candidates, key=key)[1]"),), "victim"),
    Bug("victim_in_batch", "Scheduler._victim", "_victim may pick a sequence that is already in this step's batch",
        (("candidates = [(i, s) for i, s in enumerate(self.running) if s.seq_id not in scheduled]",
          "candidates = list(enumerate(self.running))"),), "already in this step's batch"),
    Bug("ignores_stuck_beams", "Scheduler._victim", "_victim never picks a stuck beam first",
        (("        if stuck:\n            return stuck[-1]\n", ""),), "stuck"),
    Bug("priority_ties_oldest", "Scheduler._victim", "among equally low priorities, _victim picks the oldest",
        (("key = lambda c: (-c[1].priority, c[0])", "key = lambda c: (-c[1].priority, -c[0])"),), "priority"),
    Bug("keeps_progress", "Scheduler._preempt", "a recomputed victim keeps its num_computed_tokens, as if its KV "
        "were still there", (("        seq.num_computed_tokens = 0\n        self.waiting.appendleft(seq)",
                              "        self.waiting.appendleft(seq)"),), "0 computed)"),
    Bug("never_swaps", "Scheduler._preempt", "_preempt always recomputes, even with preemption_mode='swap'",
        (('self.config.preemption_mode == "swap" and seq.block_table', "False and seq.block_table"),), "swap"),
    Bug("waits_at_the_back", "Scheduler._preempt", "a recomputed victim waits at the back of the queue, behind "
        "requests admitted after it", (("        self.waiting.appendleft(seq)",
                                        "        self.waiting.append(seq)"),), "where in the queue"),
    Bug("drops_its_cache", "Scheduler._preempt", "a recomputed victim's full blocks are freed without going into "
        "the prefix cache (release with cache_kv=False): its recompute computes them again",
        (('        self.kv.release(seq, cache_kv=True)\n        seq.num_computed_tokens = 0\n',
          '        self.kv.release(seq, cache_kv=False)\n        seq.num_computed_tokens = 0\n'),), "prefix cache on"),
    Bug("lost_not_counted", "Scheduler._preempt", "the Preempted event of a recompute says no KV was lost",
        (('self.emit(ev.Preempted(self.step, seq.seq_id, "recompute", lost))\n        self.kv.release(seq, cache_kv=True)\n',
          'self.emit(ev.Preempted(self.step, seq.seq_id, "recompute", 0))\n        self.kv.release(seq, cache_kv=True)\n'),),
        "Preempted"),
    Bug("waits_forever", "Scheduler._reserve", "when the only victim is the sequence itself and it can never fit, "
        "_reserve skips it this step and hopes for room later",
        (("                self.running.remove(seq)\n                self._fail(seq, plan, f\"needs more than the "
          "{self.pool.num_blocks} blocks of the pool\")\n                return False",
          "                return False"),), "livelocks the scheduler"),
    Bug("reserve_one_victim", "Scheduler._reserve", "_reserve preempts one victim and grows the table whether or "
        "not that made room", (("        while self.kv.blocks_to_write(seq, num_new) > self.kv.num_available_blocks:",
                                "        if self.kv.blocks_to_write(seq, num_new) > self.kv.num_available_blocks:"),),
        "MemoryError"),
)

EQUIVALENT = {
}
