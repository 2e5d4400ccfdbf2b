"""Known bugs of the step-commit lab (nanoserve/request_table.py), and its equivalent mutants. See make.py."""

from make import Bug

BUGS = (
    Bug("eos_before_min_tokens", "RequestTable.append_token", "EOS stops a sequence even before min_tokens",
        (("if may_stop and (is_eos or", "if is_eos or may_stop and ("),), "min_tokens"),
    Bug("eos_ignored_flag", "RequestTable.append_token", "ignore_eos is not honoured: EOS always stops",
        (("is_eos = token.token_id == self.eos_token_id and not params.ignore_eos",
          "is_eos = token.token_id == self.eos_token_id"),), "ignore_eos"),
    Bug("length_before_stop", "RequestTable.append_token", "the length limits are decided before the stop "
        "conditions: EOS as the last allowed token says length",
        (("        if may_stop and (is_eos or token.token_id in params.stop_token_ids or hit_stop_string or "
          "grammar_over):\n            status = SequenceStatus.FINISHED_STOPPED\n        elif n >= params.max_tokens "
          "or seq.num_tokens >= self.config.max_model_len:\n            status = SequenceStatus.FINISHED_LENGTH",
          "        if n >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:\n            status = "
          "SequenceStatus.FINISHED_LENGTH\n        elif may_stop and (is_eos or token.token_id in "
          "params.stop_token_ids or hit_stop_string or grammar_over):\n            status = "
          "SequenceStatus.FINISHED_STOPPED"),), "stop wins over length"),
    Bug("no_flush", "RequestTable.append_token", "a finishing token does not release the text held back",
        (("        if status is not None:   # release the text held back in case it started a stop string\n"
          "            delta += detokenizer.flush()\n", ""),), "held back"),
    Bug("max_model_len_off_by_one", "RequestTable.append_token", "max_model_len is reached one token late",
        (("seq.num_tokens >= self.config.max_model_len", "seq.num_tokens > self.config.max_model_len"),),
        "max_model_len"),
    Bug("keeps_tokens_after_stop", "RequestTable.append", "append goes on with the tokens after one that "
        "finished the sequence (only the list's last token may finish it)",
        (("            if status is not None:\n", "            if status is not None and token is tokens[-1]:\n"),),
        "finishes the sequence is the last"),
    Bug("delta_overwritten", "RequestTable.append", "a second append in the same step replaces the step's text "
        "instead of adding to it", (('self.deltas[seq.seq_id] = self.deltas.get(seq.seq_id, "") + delta',
                                     "self.deltas[seq.seq_id] = delta"),), "accumulates"),
    Bug("ends_request_on_status", "RequestTable.finish", "the request ends when every sequence's status says "
        "finished, even while the table still holds one",
        (("if not any(s.seq_id in self.sequences for s in request.seqs):",
          "if request.finished:"),), "LAST sequence"),
    Bug("closes_twice", "RequestTable.finish", "finish closes a sequence the scheduler already closed, "
        "overwriting its status", (("        if not seq.is_finished:   # (the scheduler already closed sequences "
                                    "it failed)\n            self.scheduler.finish(seq, status)",
                                    "        self.scheduler.finish(seq, status)"),), "keeps its status"),
    Bug("proposer_kept", "RequestTable.finish", "the proposer never forgets a finished sequence's drafts",
        (("        if self.proposer:\n            self.proposer.release(seq.seq_id)\n", ""),), "proposer"),
    Bug("loud_when_quiet", "RequestTable.finish", "quiet is ignored: a pruned beam also says SequenceFinished",
        (("        if not quiet:             # (a pruned beam is no completion: BeamPruned said it all)\n",
          "        if True:\n"),), "quiet"),
    Bug("shared_detokenizer", "RequestTable.fork", "the child shares the parent's detokenizer object",
        (("self.detokenizers[child_id] = self.detokenizers[parent.seq_id].fork()",
          "self.detokenizers[child_id] = self.detokenizers[parent.seq_id]"),), "detokenizer"),
    Bug("id_in_use", "RequestTable.fork", "the child's id is taken as the request gives it, even when in use",
        (("        while child_id in self.sequences or child_id in self.requests:   # a user's request may have "
          "this id\n            child_id = request.fork_id()\n", ""),), "in use"),
    Bug("not_running", "RequestTable.fork", "the child is not handed to the scheduler: it never runs",
        (("        self.scheduler.running.append(child)\n", ""),), "scheduler"),
    Bug("pruned_kept_in_request", "RequestTable.prune", "a pruned beam stays one of the request's sequences",
        (("        self.requests[seq.request_id].seqs.remove(seq)\n", ""),), "request's sequences"),
    Bug("pruned_not_marked", "RequestTable.prune", "a pruned beam is not marked pruned",
        (("        seq.pruned = True\n", ""),), "pruned"),
)

EQUIVALENT = {
}
