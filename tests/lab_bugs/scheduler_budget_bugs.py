"""Known bugs of the scheduler-budget lab (nanoserve/scheduler.py), and its equivalent mutants. See make.py."""

from make import Bug

BUGS = (
    Bug("always_chunks", "Scheduler._chunk_size", "_chunk_size cuts prompts to the budget even with chunked prefill "
        "switched off", (("return budget if self.config.enable_chunked_prefill else 0", "return budget"),),
        "enable_chunked_prefill=False"),
    Bug("never_chunks", "Scheduler._chunk_size", "_chunk_size returns 0 for any prompt longer than the budget, "
        "chunked prefill or not (it never runs)",
        (("return budget if self.config.enable_chunked_prefill else 0", "return 0"),),
        "enable_chunked_prefill=True"),
    Bug("ignores_cache", "Scheduler._chunk_size", "_chunk_size counts cached tokens as still to compute",
        (("seq.num_tokens - max(num_cached, seq.num_computed_tokens)",
          "seq.num_tokens - seq.num_computed_tokens"),), "cached"),
    Bug("prefills_first", "Scheduler._schedule_running", "prefill chunks are scheduled before decodes, so a long "
        "prompt starves a streaming request", (("for seq in decodes + prefills:", "for seq in prefills + decodes:"),),
        "decodes"),
    Bug("no_budget_cap", "Scheduler._schedule_running", "a chunk is not cut to the budget left: one long prompt "
        "blows the step's token budget",
        (("num_new = min(seq.num_uncomputed_tokens + len(draft), planning.budget)",
          "num_new = seq.num_uncomputed_tokens + len(draft)"),
         ("                planning.budget -= num_new", "                planning.budget = max(planning.budget - num_new, 0)")),
        "budget"),
    Bug("drafts_past_budget", "Scheduler._schedule_running", "a decode keeps all its drafts even when the budget "
        "cut its chunk", (("            draft = draft[: max(0, num_new - seq.num_uncomputed_tokens)]   # what the "
                          "budget leaves room for\n", ""),), "drafts"),
    Bug("schedules_preempted", "Scheduler._schedule_running", "a sequence preempted earlier in the pass still gets "
        "a chunk", (("            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop\n"
                     "                continue\n", ""),), "no longer RUNNING"),
    Bug("spends_refused_budget", "Scheduler._schedule_running", "the budget is spent even when _reserve found no "
        "blocks and added no chunk",
        (("                self._add_chunk(planning.plan, seq, num_new, planning.scheduled, draft)\n"
          "                planning.budget -= num_new",
          "                self._add_chunk(planning.plan, seq, num_new, planning.scheduled, draft)\n"
          "            planning.budget -= num_new"),), "spend no budget"),
)

EQUIVALENT = {
    'Scheduler._schedule_running:return: break :: break -> continue':
        'after `if planning.budget == 0`: the loop never raises the budget again, so skipping every remaining sequence one by one (continue) adds exactly the chunks stopping (break) adds: none',
    'Scheduler._schedule_running:constant: draft = draft[: max(0, num_new - seq.num_uncomputed_tokens)]   # what the budget leaves room for :: 0 -> -1':
        'drafts exist only for decoding sequences (1 uncomputed token) and num_new >= 1 while budget is left, so num_new - uncomputed >= 0 and max(-1, x) == max(0, x)',
}
