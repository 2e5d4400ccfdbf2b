"""After sampling: one token joins its sequence, and whether that finishes it.

For every token the engine keeps (one per step, or several when speculative
decoding accepted drafts), `append_token` records it with its log-probs,
turns it into text (holding back text that may be the start of a stop
string), and checks the stop conditions in their order:

1. nothing stops a sequence before `min_tokens` (EOS and stop strings included);
2. EOS (unless `ignore_eos`), a stop token id, a completed stop string, or a
   structured output's grammar that can only end here: "stop";
3. `max_tokens` output tokens, or `max_model_len` tokens in all: "length".

With structured output the token also advances the sequence's grammar matcher
(the only place it advances) and gets a TokenConstrained event. It emits the
token's TokenSampled event; freeing the sequence is the engine's
`_finish`, which it calls with the status returned here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nanoserve import events as ev
from nanoserve.sampler import SampledToken
from nanoserve.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:                      # (a type only: engine.py imports this module)
    from nanoserve.engine import LLMEngine


def append_token(engine: LLMEngine, seq: Sequence, token: SampledToken) -> tuple[SequenceStatus | None, str]:
    """One token: text, logprobs, stop conditions. Returns (finished status or None, new text).

    `engine` is the LLMEngine (its detokenizers, EOS id, max_model_len and event stream).
    """
    params = seq.params
    seq.output_token_ids.append(token.token_id)
    seq.cumulative_logprob += token.logprob
    if seq.logprobs is not None:
        seq.logprobs.append(token.top_logprobs or {token.token_id: token.logprob})
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
    n = seq.num_output_tokens
    grammar_over = False
    if seq.grammar is not None:                     # raises if the grammar refuses it (the request fails)
        grammar_over = seq.grammar.accept(token.token_id)
        if token.mask is not None:
            engine.emit(ev.TokenConstrained(engine.step_count, seq.seq_id, token.token_id, token.mask.num_allowed,
                                            seq.grammar.vocab_size, token.mask.top_masked, token.mask.forced))
    may_stop = n >= params.min_tokens               # nothing stops a request before min_tokens
    delta, hit_stop_string = engine.detokenizers[seq.seq_id].update(seq.output_token_ids, may_stop)
    status = None
    is_eos = token.token_id == engine.eos_token_id and not params.ignore_eos
    if may_stop and (is_eos or token.token_id in params.stop_token_ids or hit_stop_string or grammar_over):
        status = SequenceStatus.FINISHED_STOPPED
    elif n >= params.max_tokens or seq.num_tokens >= engine.config.max_model_len:
        status = SequenceStatus.FINISHED_LENGTH
    if status is not None:   # release the text held back in case it started a stop string
        delta += engine.detokenizers[seq.seq_id].flush()
    engine.emit(ev.TokenSampled(engine.step_count, seq.seq_id, token.token_id, delta, token.logprob))
    seq.output_text += delta
    return status, delta
