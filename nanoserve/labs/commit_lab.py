"""Lab step-commit: applying a step's sampled tokens to the requests (nanoserve/request_table.py).

The compute phase chose tokens without touching any bookkeeping; the commit
phase applies them through the request table's verbs. The student writes
`RequestTable.append_token` (one token: text, log-probs, the stop conditions
in their order), `append` (a step's tokens for one sequence, until one
finishes it), `finish` (close a sequence: free its blocks, forget it, end
the request with its last sequence), `fork` (a new sequence of the same
request sharing the parent's blocks) and `prune` (drop a beam). The first
checks call each verb on a table built with the engine's own scheduler, KV
manager and pool (here, in the checker; the table is the student's, in the
worker), helpers first; then the real engine runs parallel sampling, beam
search, stop conditions and forks with the student's table, and every event
of every step is compared with the engine's own table's.
"""

from __future__ import annotations

import torch

from nanoserve.components import Components
from nanoserve.events import BeamPruned, Forked, SequenceFinished, TokenConstrained, TokenSampled
from nanoserve.labs.commit_setup import EOS, Grammar, Proposer, Setup, _status, same_events, token
from nanoserve.labs.common import SIGNATURES
from nanoserve.labs.drive import prompts
from nanoserve.labs.lab import Check, CheckFailed, Context, Lab, expect

APPEND_TOKEN_HINT = ("append_token: record the token on the sequence (its id, its log-prob's running sum, its "
                     "log-probs when they are asked for, the time of the first), let the detokenizer find the new "
                     "text, then decide in the module docstring's order: nothing stops before min_tokens; then the "
                     "reasons that say \"stop\"; then the limits that say \"length\"")


def append_token(ctx: Context) -> None:
    from nanoserve.sequence import SequenceStatus
    from nanoserve.structured_output import MaskInfo
    stop, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
    s = Setup(ctx)
    seq = s.request("a", max_tokens=8, logprobs=1)
    got = s.table.append_token(seq, token(7, -0.25, {7: -0.25, 9: -1.5}))
    expect(isinstance(got, tuple) and len(got) == 2 and got[0] is None and got[1] == "h",
           f"append_token of an ordinary first token returned {got}, expected (None, 'h')", APPEND_TOKEN_HINT)
    expect(list(seq.output_token_ids) == [7] and abs(seq.cumulative_logprob + 0.25) < 1e-9,
           f"after one token (7, log-prob -0.25) the sequence has output {list(seq.output_token_ids)} and "
           f"cumulative log-prob {seq.cumulative_logprob}", "append the id; add its log-prob to the running sum")
    expect(list(seq.logprobs) == [{7: -0.25, 9: -1.5}], f"the sequence's log-probs are {seq.logprobs}, expected "
           "[{7: -0.25, 9: -1.5}] (the token's top log-probs)", "with logprobs asked for, append the token's "
           "top_logprobs (or, when it has none, a one-entry dict of the chosen token)")
    first = seq.first_token_time
    expect(first is not None, "the first token left first_token_time unset",
           "the time of the first token is when the user starts seeing output (time.monotonic())")
    sampled = [e for e in s.events if isinstance(e, TokenSampled)]
    expect([(e.step, e.seq_id, e.token_id, e.text, e.logprob) for e in sampled] == [(5, "a", 7, "h", -0.25)],
           f"append_token emitted {s.events}, expected one TokenSampled(5, 'a', 7, 'h', -0.25)",
           "emit TokenSampled(step, seq_id, token id, the new text, log-prob) for every token")
    got = s.table.append_token(seq, token(8, -1.0))
    expect(got == (None, "i") and list(seq.logprobs)[-1] == {8: -1.0} and seq.first_token_time == first,
           f"a second token without top log-probs: returned {got}, log-probs {seq.logprobs}, first token time "
           f"{'kept' if seq.first_token_time == first else 'changed'}", APPEND_TOKEN_HINT)
    expect(s.sched.running == [seq] and "a" in s.table.sequences and not any(
        isinstance(e, SequenceFinished) for e in s.events), "append_token finished the sequence itself",
        "append_token only returns the status; the caller (append) finishes the sequence")

    # (params, tokens already out, the token, the expected status, why)
    rows = (({}, 0, EOS, stop, "EOS stops"),
            ({"ignore_eos": True}, 0, EOS, None, "EOS with ignore_eos is an ordinary token"),
            ({"min_tokens": 3}, 1, EOS, None, "EOS before min_tokens does not stop"),
            ({"min_tokens": 3}, 2, EOS, stop, "EOS as the min_tokens-th token stops"),
            ({"stop_token_ids": [11]}, 0, 11, stop, "a stop token id stops"),
            ({"stop_token_ids": [11], "min_tokens": 2}, 0, 11, None, "a stop token id before min_tokens"),
            ({"stop": ["ml"]}, 1, 11, stop, "the stop string 'ml' completes"),
            ({"stop": ["ml"], "min_tokens": 3}, 1, 11, None, "a stop string before min_tokens"),
            ({"max_tokens": 3}, 2, 9, length, "the max_tokens-th token"),
            ({"max_tokens": 3}, 1, 9, None, "one token below max_tokens"),
            ({"max_tokens": 3}, 2, EOS, stop, "EOS as the last allowed token: stop wins over length"),
            ({"max_tokens": 3, "min_tokens": 3}, 2, EOS, stop, "EOS at min_tokens = max_tokens"),
            ({"max_tokens": 2, "stop_token_ids": [11]}, 1, 11, stop, "a stop id as the last allowed token"),
            ({"max_tokens": 50, "max_model_len": 8}, 2, 9, length, "the sequence reaches max_model_len"),
            ({"max_tokens": 50, "max_model_len": 9}, 2, 9, None, "one below max_model_len"),
            ({"max_tokens": 50, "max_model_len": 8, "ignore_eos": True}, 2, EOS, length,
             "an ignored EOS at max_model_len"))
    for params, before, tid, want, why in rows:
        params = dict(params)
        t = Setup(ctx, max_model_len=params.pop("max_model_len", 64))
        seq = t.request("r", **params)
        for i in range(before):
            t.table.append_token(seq, token(12 + i))
        got = t.table.append_token(seq, token(tid))
        expect(isinstance(got, tuple) and len(got) == 2 and got[0] == want,
               f"{why}: {params or 'default params'}, {before} token(s) already out, a prompt of 5, then token "
               f"{tid} (EOS is {EOS}): append_token returned status {_status(got[0] if isinstance(got, tuple) else got)}"
               f", expected {_status(want)}", APPEND_TOKEN_HINT)

    t = Setup(ctx)
    seq = t.request("h", stop=["xyz"], max_tokens=3)     # the last 2 letters are held back: maybe a stop string
    texts = [t.table.append_token(seq, token(i))[1] for i in (0, 1, 2)]
    expect(texts == ["", "", "abc"] and seq.output_text == "abc",
           f"with the stop string 'xyz' and max_tokens=3, tokens a, b, c gave texts {texts} (output text "
           f"{seq.output_text!r}), expected ['', '', 'abc']", "text that might start a stop string is held back; "
           "when the sequence finishes, release what is held back (the detokenizer's flush) and add the new "
           "text to the sequence's output_text")

    t = Setup(ctx)
    grammar = Grammar(ends_after=2)
    seq = t.request("g", grammar=grammar)
    got1 = t.table.append_token(seq, token(4, mask=MaskInfo(3, True, False)))
    got2 = t.table.append_token(seq, token(5))
    constrained = [(e.seq_id, e.token_id, e.num_allowed, e.vocab_size, e.top_masked, e.forced)
                   for e in t.events if isinstance(e, TokenConstrained)]
    expect(grammar.accepted == [4, 5], f"the grammar's matcher was given {grammar.accepted}, expected [4, 5]",
           "every token advances the sequence's grammar matcher (accept), and only here")
    expect(_status(got1[0]) == "None" and got2[0] == stop, f"a grammar that can only end after its 2nd token: "
           f"statuses {_status(got1[0])}, {_status(got2[0])}, expected None, stop", "when the grammar says it can only "
           "end here, the sequence stops")
    expect(constrained == [("g", 4, 3, 100, True, False)], f"TokenConstrained events {constrained}, expected one "
           "for the masked token 4: ('g', 4, 3 allowed, vocab 100, top masked, not forced)",
           "a token the grammar's mask shaped (token.mask) gets a TokenConstrained event")


APPEND_HINT = ("append: one sampling step of one sequence: count it, apply its tokens one at a time, and stop at "
               "the first that ends the sequence (finish it, with the text of this call); otherwise keep this "
               "step's text for the sequence and return the request's output")


def append(ctx: Context) -> None:
    from nanoserve.outputs import RequestOutput
    s = Setup(ctx)
    seq = s.request("a", max_tokens=10, stop_token_ids=[11])
    out = s.table.append(seq, [token(3)])
    expect(isinstance(out, RequestOutput) and out.outputs[0].token_ids == [3] and out.outputs[0].delta == "d" and
           not out.finished, f"append of token 3 returned {out!r}, expected the request's output with token_ids [3] "
           "and delta 'd', not finished", APPEND_HINT)
    out = s.table.append(seq, [token(4), token(5)])
    expect(out.outputs[0].token_ids == [3, 4, 5] and out.outputs[0].delta == "def",
           f"a second append in the same step (tokens 4, 5) gave token_ids {out.outputs[0].token_ids} and delta "
           f"{out.outputs[0].delta!r}, expected [3, 4, 5] and 'def' (the step's text so far)",
           "the text a sequence adds in one step accumulates over the step's calls (self.deltas)")
    expect(seq.num_sampling_steps == 2, f"after two appends num_sampling_steps is {seq.num_sampling_steps}",
           "each call is one sampling step of the sequence, however many tokens it brings")
    totals = dict(s.table.spec_totals)
    expect(totals.get("forwards") == 2 and totals.get("tokens") == 3,
           f"spec_totals after two appends of 1 and 2 tokens: {totals}, expected forwards 2 and tokens 3",
           "count each call in spec_totals['forwards'] and each token applied in spec_totals['tokens']")
    s.table.begin_step()
    out = s.table.append(seq, [token(6), token(11), token(7)])
    expect(list(seq.output_token_ids) == [3, 4, 5, 6, 11], f"append of tokens 6, 11 (a stop id), 7 left the "
           f"output {list(seq.output_token_ids)}, expected [3, 4, 5, 6, 11]",
           "the token that finishes the sequence is the last one applied: the rest of the list is dropped")
    expect(out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].delta == "gl",
           f"that append returned finished={out.finished}, finish_reason={out.outputs[0].finish_reason!r}, delta="
           f"{out.outputs[0].delta!r}; expected True, 'stop', 'gl'", APPEND_HINT)
    expect("a" not in s.table.sequences and seq not in s.sched.running and s.live_blocks() == [],
           "a sequence that appended its stop token is still in the table, or still runs, or holds blocks",
           "when a token ends the sequence, append finishes it (self.finish) with that status")
    expect(dict(s.table.spec_totals).get("tokens") == 5, f"spec_totals['tokens'] is "
           f"{dict(s.table.spec_totals).get('tokens')} after 5 tokens applied", "count only the tokens applied")


FINISH_HINT = ("finish: the sequence leaves everything that holds it: its detokenizer, the proposer's state, the "
               "scheduler (which frees its blocks; unless it already closed it), the table's sequences; say so "
               "(unless quiet); the request is over when none of its sequences is left in the table")


def finish(ctx: Context) -> None:
    from nanoserve.sequence import SequenceStatus
    proposer = Proposer()
    s = Setup(ctx, proposer=proposer)
    a = s.request("a")
    b = s.request("b")
    s.table.append_token(a, token(3))
    out = s.table.finish(a, SequenceStatus.FINISHED_LENGTH, "xy")
    expect(out.request_id == "a" and out.finished and out.outputs[0].finish_reason == "length" and
           out.outputs[0].delta == "xy", f"finish(a, length, 'xy') returned {out!r}; expected request a's output, "
           "finished, finish_reason 'length', delta 'xy'", FINISH_HINT)
    expect(a.status is SequenceStatus.FINISHED_LENGTH and a not in s.sched.running and a.block_table == [],
           f"after finish, a has status {a.status.name}, is {'still' if a in s.sched.running else 'not'} running "
           f"and holds blocks {a.block_table}", "the scheduler closes a sequence: self.scheduler.finish(seq, status) "
                                               "drops it from its queue and frees its blocks")
    expect("a" not in s.table.sequences and "a" not in s.table.detokenizers and "a" not in s.table.requests,
           "after finishing request a's only sequence, the table still has it (sequences, detokenizers or requests)",
           FINISH_HINT)
    expect("a" in s.table.finished_ids, "a finished request is not in finished_ids",
           "remember the ids of finished requests (errors about them say 'already finished')")
    expect(proposer.released == ["a"], f"the proposer was told to forget {proposer.released}, expected ['a']",
           "a finished sequence's draft state is released (self.proposer.release(seq_id)) when there is a proposer")
    done = [(e.step, e.seq_id, e.finish_reason, e.num_output_tokens, e.error) for e in s.events
            if isinstance(e, SequenceFinished)]
    expect(done == [(5, "a", "length", 1, "")], f"finish emitted SequenceFinished {done}, expected "
           "[(5, 'a', 'length', 1, '')]", "emit SequenceFinished(step, seq_id, finish reason, output tokens, error)")
    expect("b" in s.table.sequences and b in s.sched.running, "finishing a also closed b", FINISH_HINT)

    t = Setup(ctx)
    p = t.request("p")
    child = t.child(p, "p.1")
    t.events.clear()
    out = t.table.finish(p, SequenceStatus.FINISHED_STOPPED)
    expect("p" in t.table.requests and not out.finished and "p" not in t.table.finished_ids,
           "finishing a request's first sequence while its fork still runs ended the request",
           "the request ends with its LAST sequence: check whether any of its sequences is still in the table")
    out = t.table.finish(child, SequenceStatus.FINISHED_STOPPED, quiet=True)
    expect("p" not in t.table.requests and out.finished and "p" in t.table.finished_ids,
           "finishing the request's last sequence did not end the request", FINISH_HINT)
    expect([e.seq_id for e in t.events if isinstance(e, SequenceFinished)] == ["p"],
           f"SequenceFinished events {[e.seq_id for e in t.events if isinstance(e, SequenceFinished)]}, expected "
           "['p'] (the second finish was quiet)", "quiet=True: no SequenceFinished (a pruned beam says BeamPruned)")
    expect(t.live_blocks() == [], f"blocks {t.live_blocks()} are still held after both sequences finished",
           FINISH_HINT)

    u = Setup(ctx)
    f = u.request("f")
    u.sched.finish(f, SequenceStatus.FINISHED_ABORTED)      # the scheduler failed it (a sequence it cannot fit)
    f.error = "needs more blocks"
    u.events.clear()
    try:
        out = u.table.finish(f, SequenceStatus.FINISHED_LENGTH)
    except RuntimeError as exc:       # the sequence's own guard: a finished status never changes
        raise CheckFailed(f"finish of a sequence the scheduler had already closed (aborted) raised "
                          f"{' '.join(str(exc).split())[:160]}", "a sequence the scheduler already finished keeps "
                          "its status: do not close it again") from None
    expect(f.status is SequenceStatus.FINISHED_ABORTED and out.outputs[0].finish_reason == "abort",
           f"finish of a sequence the scheduler had already closed as aborted changed its status to {f.status.name}",
           "a sequence the scheduler already finished keeps its status: do not close it again")
    done = [(e.finish_reason, e.error) for e in u.events if isinstance(e, SequenceFinished)]
    expect(done == [("abort", "needs more blocks")], f"its SequenceFinished said {done}, expected "
           "[('abort', 'needs more blocks')]", "the event states the sequence's own status and error")

    w = Setup(ctx)
    m = w.request("m")
    m2 = w.child(m, "m.1")
    for seq in (m, m2):                                     # the scheduler failed both forks in one step
        w.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    w.table.finish(m, SequenceStatus.FINISHED_ABORTED)
    expect("m" in w.table.requests and "m" not in w.table.finished_ids,
           "the scheduler closed both sequences of request m; after the table finished the first, the request "
           "is gone from the table although it still holds m.1", "the request ends with its LAST sequence in the "
           "table, not when every status says finished: the scheduler may close two of them in one step")
    out = w.table.finish(m2, SequenceStatus.FINISHED_ABORTED)
    expect(out.finished and "m" not in w.table.requests, "finishing m.1 too did not end request m", FINISH_HINT)


FORK_HINT = ("fork: the child is a new sequence of the same request (a fresh id from the request, never one in "
             "use), shares the parent's blocks through the KV manager, runs from now, and is known wherever the "
             "parent is (the request's sequences, the table, a detokenizer of its own at the parent's point)")


def fork(ctx: Context) -> None:
    s = Setup(ctx)
    p = s.request("p", prompt_len=6)
    s.table.append_token(p, token(3))
    refs = {b: s.pool.blocks[b].ref_count for b in p.block_table}
    child = s.table.fork(p, torch.Generator().manual_seed(3), 3)
    expect(child is not None and child.seq_id == "p.1" and child.request_id == "p",
           f"fork returned {getattr(child, 'seq_id', child)!r}, expected the new sequence 'p.1'", FORK_HINT)
    expect(list(child.block_table) == list(p.block_table) and
           all(s.pool.blocks[b].ref_count == refs[b] + 1 for b in p.block_table),
           f"the child holds {list(child.block_table)} (the parent {list(p.block_table)}); ref counts "
           f"{[s.pool.blocks[b].ref_count for b in p.block_table]}, expected one more each",
           "the KV manager shares the blocks: self.kv.fork(parent, child, seed)")
    forked = [(e.parent_id, e.seq_id, e.seed) for e in s.events if isinstance(e, Forked)]
    expect(forked == [("p", "p.1", 3)], f"Forked events {forked}, expected [('p', 'p.1', 3)]",
           "hand the seed to the KV manager's fork (it emits Forked)")
    expect(child in s.sched.running and s.table.sequences.get("p.1") is child and
           list(s.table.requests["p"].seqs) == [p, child],
           "the child is missing from the scheduler's running list, the table's sequences or the request's "
           "sequences", FORK_HINT)
    det_p, det_c = s.table.detokenizers["p"], s.table.detokenizers.get("p.1")
    expect(det_c is not None and det_c is not det_p, "the child has no detokenizer of its own",
           "the child's text goes on from the parent's point on its own: give it the parent detokenizer's fork()")
    s.table.append_token(child, token(4))
    s.table.append_token(p, token(5))
    expect(child.output_text == "de" and p.output_text == "df", f"after the fork the child's text is "
           f"{child.output_text!r} and the parent's {p.output_text!r}, expected 'de' and 'df'", FORK_HINT)
    s.table.sequences["p.2"] = s.table.sequences["p"]      # a user's request may already be called "p.2"
    second = s.table.fork(p, torch.Generator())
    expect(second.seq_id == "p.3", f"with 'p.2' already in use the next fork got id {second.seq_id!r}, "
           "expected 'p.3'", "keep asking the request for a new id while the one it gives is in use (as a "
           "sequence or a request id)")
    t = Setup(ctx)
    q = t.request("q")
    t.request("q.1")                                        # a request whose id the first fork of q would take
    c = t.table.fork(q, torch.Generator())
    expect(c.seq_id == "q.2", f"with a request called 'q.1', the fork of q got id {c.seq_id!r}, expected 'q.2'",
           "an id in use as a request's id is taken too")


PRUNE_HINT = ("prune: a dropped beam is no completion of its request: say so (BeamPruned), mark it, take it out "
              "of the request's sequences, and close it quietly (its blocks freed)")


def prune(ctx: Context) -> None:
    from nanoserve.sequence import SequenceStatus
    s = Setup(ctx)
    p = s.request("b", prompt_len=6)
    s.table.append_token(p, token(3))
    child = s.table.fork(p, torch.Generator())
    s.events.clear()
    out = s.table.prune(child)
    expect([e.seq_id for e in s.events if isinstance(e, BeamPruned)] == ["b.1"] and
           not any(isinstance(e, SequenceFinished) for e in s.events),
           f"prune of b.1 emitted {s.events}, expected BeamPruned for b.1 and no SequenceFinished", PRUNE_HINT)
    expect(child.pruned and child.status is SequenceStatus.FINISHED_ABORTED,
           f"the pruned beam has pruned={child.pruned}, status {child.status.name}", PRUNE_HINT)
    expect(list(s.table.requests["b"].seqs) == [p] and "b.1" not in s.table.sequences,
           "the pruned beam is still one of the request's sequences or in the table", PRUNE_HINT)
    expect(out.request_id == "b" and [c.seq_id for c in out.outputs] == ["b"] and not out.finished,
           f"prune returned {out!r}, expected request b's output with only b, not finished", PRUNE_HINT)
    expect(s.live_blocks() == sorted(p.block_table), f"blocks held after the prune: {s.live_blocks()}, expected "
           f"only the parent's {sorted(p.block_table)}", "a pruned beam frees its blocks (shared ones lose a holder)")


def engine_stops(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams as SP
    p = prompts(2, 7, seed=3)[0]     # greedy on this prompt: 24, 172, 253, 86, 77 ("V" is 86, "M" 77), 106, ...
    same_events(ctx, [("a", p, SP(max_tokens=6, temperature=0, ignore_eos=True)),
                      ("b", p, SP(max_tokens=6, temperature=0, stop_token_ids=[86], logprobs=2)),
                      ("c", p, SP(max_tokens=6, temperature=0, stop_token_ids=[86], min_tokens=5)),
                      ("d", p, SP(max_tokens=9, temperature=0, stop=["M"])),
                      ("e", p, SP(max_tokens=9, temperature=0, stop=["VM"], include_stop_str_in_output=True)),
                      ("f", p, SP(max_tokens=9, temperature=0, stop=["VM"], min_tokens=5)),
                      ("g", p, SP(max_tokens=30, temperature=0.8, seed=6, min_tokens=4))],
                config={"max_model_len": 14},
                hint="the stop conditions in their order, the text held back and released, and the step's outputs")


def engine_forks(ctx: Context) -> None:
    from nanoserve.sampling_params import SamplingParams
    p = prompts(3, 6, seed=8)
    same_events(ctx, [("n", p[0], SamplingParams(n=3, max_tokens=5, temperature=0.9, seed=2)),
                      ("f", p[1], SamplingParams(max_tokens=6, temperature=0.9, seed=3)),
                      ("beam", p[2], SamplingParams(n=2, beam_width=3, temperature=0, max_tokens=5,
                                                    ignore_eos=True))],
                config={"num_blocks": 48}, fork_at={"f": 2},
                hint="n > 1 forks its completions after the prompt; beam search forks, prunes and appends each step; "
                     "every fork shares its parent's blocks and text")
    # A model with KV cache groups (tiny-gemma3: two sliding-window layers, one full): a fork shares every group's
    # table too (kv.fork_groups, a GroupsForked event), past the window's 8 tokens
    same_events(ctx, [("g", p[0], SamplingParams(n=2, max_tokens=12, temperature=0.9, seed=4))],
                config={"model": "tiny-gemma3", "num_blocks": 96}, fork_at={"g": 3},
                hint="on a model with KV cache groups the child shares the parent's tables in groups 1.. too: "
                     "self.kv.fork_groups(parent, child) when the parent has group tables")


LAB = Lab(
    name="step-commit",
    title="Applying a step's tokens: append, stop conditions, finish and free, forks and beams",
    module="nanoserve.request_table",
    intro="""\
The request table of the nanoserve engine: its commit phase's verbs. The compute phase chose a token (or several,
with speculative decoding) for each sequence; here they are applied: appended with their text and log-probs, the
stop conditions decided in their order, a finished sequence closed and its blocks freed, a request forked into
n completions or beams, a beam pruned. Every other part of the engine is the reference's.""",
    blanks={
        "RequestTable.append_token": "append the token (id, log-prob sum, log-probs when asked, first token time), "
                                     "advance the grammar when there is one (TokenConstrained when a mask shaped "
                                     "the token), ask the detokenizer for the new text, decide the status in the "
                                     "docstring's order, release held-back text when finished, emit TokenSampled, "
                                     "extend output_text; return (status or None, text)",
        "RequestTable.append": "count the sampling step (num_sampling_steps, spec_totals forwards/tokens); apply "
                               "the tokens one by one; the first that finishes the sequence ends the call "
                               "(finish with this call's text); else add the text to this step's deltas and return "
                               "the request's output",
        "RequestTable.finish": "record the delta; drop the detokenizer and the proposer's state; let the scheduler "
                               "close the sequence unless it already did; forget it; emit SequenceFinished unless "
                               "quiet; end the request (requests -> finished_ids) when none of its sequences is "
                               "left in the table; return the request's output",
        "RequestTable.fork": "a fresh child id from the request that is in use nowhere; the parent's fork(); the "
                             "KV manager shares the blocks (and, when the parent has KV cache group tables, "
                             "those too: fork_groups); the child runs and joins the request, the table and "
                             "gets its own detokenizer (the parent's fork()); return it",
        "RequestTable.prune": "emit BeamPruned, mark it pruned, take it out of the request's sequences, finish it "
                              "aborted and quietly; return the output",
    },
    contracts={
        "RequestTable.append_token": "After the call the token is part of the sequence (ids, log-prob sum, "
                                     "log-probs if asked, first-token time, grammar) and TokenSampled states it "
                                     "with the text it released. Returns (status, text): None until min_tokens; "
                                     "then FINISHED_STOPPED for EOS (unless ignored), a stop id, a stop string or "
                                     "a grammar that ends; then FINISHED_LENGTH at max_tokens or max_model_len. "
                                     "A finishing token releases all the text held back. Never finishes the "
                                     "sequence itself.",
        "RequestTable.append": "One sampling step of one sequence: its tokens applied in order up to the first "
                               "that finishes it (the rest dropped) and then it is finished; the text of the "
                               "step accumulates across calls in one step; returns the request's output.",
        "RequestTable.finish": "After the call the sequence is closed (status set once, by the scheduler, which "
                               "frees its blocks) and known nowhere in the table; SequenceFinished said so unless "
                               "quiet; the request ends with its last sequence in the table. Returns the "
                               "request's output.",
        "RequestTable.fork": "Returns a running child of the same request with an id in use nowhere, sharing "
                             "every block of the parent in every KV cache group (Forked, GroupsForked), known to "
                             "the scheduler, the request and the table, with text that goes on from the parent's "
                             "on its own.",
        "RequestTable.prune": "The beam is closed quietly (BeamPruned, no SequenceFinished), marked pruned, no "
                              "longer one of the request's sequences, its blocks freed. Returns the output.",
    },
    invariants="Every unfinished sequence is in `sequences` with a detokenizer, in its request's `seqs` and in one "
               "scheduler queue; a request is in `requests` while any of its sequences is. A finished sequence "
               "holds no block and is known only to its request. `deltas` is this step's text per sequence.",
    components=lambda m: Components(request_table=m.RequestTable),
    checks=(
        SIGNATURES,
        Check("RequestTable.append_token: text, log-probs, the stop conditions in order", append_token,
              APPEND_TOKEN_HINT, 60, function="RequestTable.append_token"),
        Check("RequestTable.finish: closes, frees, ends the request with its last sequence", finish, FINISH_HINT,
              30, function="RequestTable.finish"),
        Check("RequestTable.fork: a new sequence sharing the parent's blocks", fork, FORK_HINT, 30,
              function="RequestTable.fork"),
        Check("RequestTable.append: a step's tokens until one finishes", append, APPEND_HINT, 30,
              function="RequestTable.append"),
        Check("RequestTable.prune: a beam dropped quietly", prune, PRUNE_HINT, 30, function="RequestTable.prune"),
        Check("real engine: stop conditions, same events every step", engine_stops,
              "run `nanoserve generate --lab step-commit=request_table.py` with stop strings and min_tokens", 240),
        Check("real engine: n > 1, forks and beam search, same events every step", engine_forks,
              "run the engine with n=3 and with beam search and compare the Forked and BeamPruned events", 240),
    ),
    why=(
        ("Why does nothing stop a sequence before min_tokens, not even a stop string already complete in the text?",
         "min_tokens is a promise to the user about the output's length; a stop condition that fired early would "
         "break it. The text before min_tokens is ordinary text: only a match that ends after it may stop."),
        ("Why does append_token return the status instead of finishing the sequence itself?",
         "With speculative decoding a step brings several tokens; the caller stops at the first that finishes and "
         "drops the rest, and finishes once with the step's whole text. Beam search and forks apply tokens to "
         "sequences whose fate is decided by the caller too."),
        ("Why does a request end when its last sequence leaves the table, and not when every sequence's status "
         "says finished?",
         "The scheduler may close two forks of one request in the same step (it could not fit them); the first "
         "one the table finishes would then see every status finished and end the request while the table still "
         "holds the other: its output and its blocks would be lost."),
    ),
    prerequisites="lesson 5 (fork and beam search); lesson 8 (stop strings)",
    minutes=50,
)
