"""The step a scenario's screenshot shows: the first where its mechanism shows.

A preemption, a prefill chunk beside a decode, an accepted draft, a prefix
hit, a copy-on-write, a swap, ... The docs' TUI screenshots
(`python docs/generate.py screens`, docs/docgen/screens.py) and the web
pages' (docs/docgen/web.py) are shot at this step.
"""

from __future__ import annotations

from nanoserve import events as ev


def showcase_step(name: str, events: list) -> int:
    """The first step where scenario `name` shows its mechanism."""
    def first(pred) -> int:
        return next(e.step for e in events if pred(e))

    if name == "memory-pressure":
        preempted = [e.step for e in events if isinstance(e, ev.Preempted)]
        return preempted[0]
    if name == "long-prompt":
        decode_steps = {e.step for e in events if isinstance(e, ev.ChunkScheduled) and not e.is_prefill}
        return first(lambda e: isinstance(e, ev.ChunkScheduled) and e.seq_id == "long"
                     and e.is_prefill and e.step in decode_steps)
    if name == "speculative-decoding":
        return first(lambda e: isinstance(e, ev.DraftVerified) and e.num_accepted > 0)
    if name == "shared-system-prompt":      # a later request reuses the system prompt's cached blocks
        return first(lambda e: isinstance(e, ev.PrefixMatched) and e.num_hit_tokens > 0 and e.step > 1)
    if name == "parallel-sampling":         # a sample writes into a shared block: copy-on-write
        return first(lambda e: isinstance(e, ev.CowCopied))
    if name == "swap-preemption":           # a victim's KV moves to the CPU pool
        return first(lambda e: isinstance(e, ev.SwappedOut))
    if name == "tensor-parallel":           # a fork's copy-on-write, replayed on both ranks
        return first(lambda e: isinstance(e, ev.CowCopied))
    if name == "sliding-window":            # a few blocks have left the local windows
        return [e.step for e in events if isinstance(e, ev.BlocksLeftWindow)][4]
    if name == "structured-output":         # the last step in which three grammars mask together
        steps = [e.step for e in events if isinstance(e, ev.TokenConstrained)]
        return max((step for step in steps if steps.count(step) >= 3), default=steps[0])
    # continuous-batching: the step in which a request is admitted after another finished
    finished = first(lambda e: isinstance(e, ev.SequenceFinished))
    return first(lambda e: isinstance(e, ev.SequenceAdmitted) and e.step > finished)
