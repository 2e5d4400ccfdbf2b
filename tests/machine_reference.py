"""What the engine state machine (test_engine_stateful.py) compares against, and what it counts.

* `reference_output`: a request run alone on an engine with every mechanism off (no prefix
  cache, no chunked prefill, a pool too big to preempt, no speculation), cached by its settings;
* `small_engine`: the engines under test, over the same tiny random Llama;
* `OutputChecks`: what every output the machine sees must satisfy (tokens only grow, finish
  reasons and their conditions, errors only where the machine caused them, and equality with
  the reference for greedy and seeded requests);
* `STATS` and `CONFIGS`: counts of what happened over every example, and the configurations
  run (printed by benchmarks/fuzz_engine.py).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_model

# The session fixtures cannot reach inside a state machine: load once per module.
# NANOSERVE_MACHINE_MODEL=tiny-gemma3 runs the machine on Gemma 3's shape: KV cache groups, windows
# freed (test_kv_groups.py runs it so, under the slow marker; the reference keeps every token's KV).
MODEL = os.environ.get("NANOSERVE_MACHINE_MODEL", "tiny-llama")
LOADED = load_model(MODEL)
VOCAB = LOADED.model.config.vocab_size
EOS = LOADED.eos_token_id
MAX_DRAIN_STEPS = 3000
MAX_LIVE = 8             # requests in flight at most (more than any pool here holds at once)
GREEDY_MARGIN = 1e-4     # compare greedy tokens only while the reference's top-2 log-prob gap exceeds this
LOGPROB_ATOL = 1e-4      # batching and chunking change float32 rounding, not more

# Pools: (block_size, num_blocks). The smaller ones cap max_model_len below prompt + max_tokens.
POOLS = [(4, 24), (4, 12), (1, 40), (16, 6), (3, 17)]
STOP_CHARS = list("aeiou tn.\x00\x06")      # the byte tokenizer: token id = byte (ASCII = its char)

STATS: Counter = Counter()   # what happened, over every example (printed by benchmarks/fuzz_engine.py)
CONFIGS: set = set()         # the engine configurations the examples ran


def small_engine(block_size, num_blocks, budget, max_num_seqs, chunked=True, max_model_len=None,
                 **more) -> LLMEngine:
    """`more`: enable_prefix_caching, preemption_mode, num_cpu_blocks, preemption_policy, speculation."""
    return LLMEngine(
        EngineConfig(model=MODEL, block_size=block_size, num_blocks=num_blocks,
                     max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                     enable_chunked_prefill=chunked, max_model_len=max_model_len, **more),
        loaded=LOADED,
    )


# Prompts share these prefixes now and then, so the prefix cache has something to hit.
PREFIXES = [list(range(1, 25)), [7, 8, 9] * 6, list(range(100, 112))]


# -- reference outputs: the same request alone on an engine with every mechanism off ------------

_REFERENCE = small_engine(16, 64, 512, 8, chunked=False, enable_prefix_caching=False, kv_window_freeing=False)
_REFERENCE_CACHE: dict[tuple, tuple[list[int], list[float], str, list[float]]] = {}


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int):
    """(token ids, top-2 margin per token, finish reason, logprob per token) of `prompt` run alone."""
    key = (tuple(prompt), params.max_tokens, params.temperature, params.seed, max_model_len,
           tuple(params.stop), tuple(params.stop_token_ids), params.min_tokens, params.ignore_eos)
    if key not in _REFERENCE_CACHE:
        engine = _REFERENCE
        # Same stop rules; cap length where the small engine's max_model_len would.
        max_tokens = min(params.max_tokens, max_model_len - len(prompt))
        ref_params = SamplingParams(max_tokens=max_tokens, temperature=params.temperature,
                                    seed=params.seed, logprobs=2, stop=params.stop,
                                    stop_token_ids=params.stop_token_ids,
                                    min_tokens=min(params.min_tokens, max_tokens), ignore_eos=params.ignore_eos)
        rid = f"ref{len(_REFERENCE_CACHE)}"
        engine.add_request(rid, prompt, ref_params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step().outputs:
                if o.request_id == rid and o.finished:
                    out = o.outputs[0]
        assert out is not None
        margins = []
        for lp in out.logprobs:
            top = sorted(lp.values(), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        chosen = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        _REFERENCE_CACHE[key] = (list(out.token_ids), margins, out.finish_reason, chosen)
    return _REFERENCE_CACHE[key]


_PROMPT_REFERENCE: dict[tuple, list] = {}


def reference_prompt_logprobs(prompt: list[int]) -> list:
    """The prompt log-probabilities (top 2) of `prompt` run alone on the mechanisms-off engine."""
    key = tuple(prompt)
    if key not in _PROMPT_REFERENCE:
        rid = f"refp{len(_PROMPT_REFERENCE)}"
        _REFERENCE.add_request(rid, prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
        while _REFERENCE.has_unfinished_requests():
            for o in _REFERENCE.step().outputs:
                if o.request_id == rid and o.finished:
                    _PROMPT_REFERENCE[key] = o.prompt_logprobs
    return _PROMPT_REFERENCE[key]


# -- what outputs must satisfy ----------------------------------------------------------------------


class OutputChecks:
    """Checks of the outputs a state machine sees. The machine provides `live` (id -> (prompt,
    params)), `tokens_seen`, `finished_ids`, `max_model_len`, `pool_tokens`, `spec`,
    `nan_injected` and `nan_failed`."""

    def _check_output(self, out) -> None:
        rid = out.request_id
        assert rid in self.live, f"output for unknown or finished request {rid}"
        prompt, params = self.live[rid]
        assert out.prompt_token_ids == prompt
        for comp in out.outputs:
            assert len(comp.token_ids) <= params.max_tokens
            assert len(prompt) + len(comp.token_ids) <= self.max_model_len
            assert not out.finished or comp.finish_reason in ("stop", "length", "abort")
        if params.use_beam_search:
            self._check_beams(out, params)
            return
        if params.n > 1 and any(c.token_ids for c in out.outputs):
            # The n first tokens are drawn in one step, and the request forks in that step.
            assert len(out.outputs) >= params.n, f"{rid}: n={params.n} has tokens in {len(out.outputs)} completions"
        comp = out.outputs[0]            # the request's own sequence; forks come after it
        # Tokens only ever grow, preemption, recompute and undone steps included.
        prev = self.tokens_seen.get(rid, [])
        assert comp.token_ids[: len(prev)] == prev, f"{rid}: tokens rewritten"
        self.tokens_seen[rid] = list(comp.token_ids)
        if not out.finished:
            assert any(c.finish_reason is None for c in out.outputs)
            return
        self._finished(rid)
        reason = comp.finish_reason
        STATS[f"requests finished ({reason})"] += 1
        if params.prompt_logprobs is not None and reason != "abort":
            self._check_prompt_logprobs(rid, prompt, params, out.prompt_logprobs)
        if reason == "stop":
            assert len(comp.token_ids) >= params.min_tokens, f"{rid}: stopped before min_tokens"
            assert comp.token_ids[-1] in {EOS, *params.stop_token_ids} or params.stop
            for s in params.stop if comp.token_ids[-1] not in {EOS, *params.stop_token_ids} else ():
                STATS["stopped by a stop string"] += 1
                break
        elif reason == "length":
            assert (len(comp.token_ids) == params.max_tokens
                    or len(prompt) + len(comp.token_ids) == self.max_model_len)
        else:
            self._check_error(rid, prompt, comp)
            return
        if params.greedy or (params.seed is not None and self.spec is None):
            self._compare_with_reference(rid, prompt, params, comp)

    def _check_prompt_logprobs(self, rid, prompt, params, got) -> None:
        """Every prompt token's log-probability (and the top ones), as alone: chunking, the prefix cache,
        preemption, swapping and undone steps must neither lose nor change one."""
        want = reference_prompt_logprobs(prompt)
        assert len(got) == len(prompt) and got[0] is None, f"{rid}: {len(got)} prompt log-probs for {len(prompt)}"
        for pos, (a, b) in enumerate(zip(got[1:], want[1:]), 1):
            assert a[prompt[pos]] == pytest.approx(b[prompt[pos]], abs=LOGPROB_ATOL), f"{rid}: prompt token {pos}"
            top = sorted(b.values(), reverse=True)       # the top k agree where the reference is not tied
            if params.prompt_logprobs and top[0] - top[1] > LOGPROB_ATOL:
                assert max(a, key=a.get) == max(b, key=b.get), f"{rid}: top prompt token at {pos}"
        STATS["prompt log-probabilities equal to the mechanisms-off engine"] += 1

    def _check_beams(self, out, params) -> None:
        if not out.finished:
            return
        self._finished(out.request_id)
        assert len(out.outputs) <= params.n
        for comp in out.outputs:
            if comp.finish_reason == "abort" and comp.error:
                self._check_error(out.request_id, out.prompt_token_ids, comp)
        STATS["beam searches finished"] += 1

    def _check_error(self, rid, prompt, comp) -> None:
        """The engine gives up only on a request that outgrew the whole pool, or whose logits were NaN."""
        assert comp.finish_reason == "abort" and comp.error, f"{rid}: finish {comp.finish_reason!r} without error"
        if "not a distribution" in comp.error:
            self.nan_failed.add(rid)
            assert len(self.nan_failed) <= self.nan_injected, f"{rid}: NaN error but no NaN row was injected"
            STATS["requests failed by NaN logits"] += 1
        else:
            assert len(prompt) + len(comp.token_ids) > self.pool_tokens, (
                f"{rid}: failed ({comp.error}) with {len(prompt) + len(comp.token_ids)} tokens in a pool "
                f"of {self.pool_tokens}")

    def _finished(self, rid) -> None:
        del self.live[rid]
        self.tokens_seen.pop(rid, None)
        self.finished_ids.append(rid)

    def _compare_with_reference(self, rid, prompt, params, comp) -> None:
        ref_tokens, margins, ref_reason, ref_logprobs = reference_output(prompt, params, self.max_model_len)
        if params.greedy:
            # Batching changes float rounding; only a clear argmax must match.
            k = next((i for i, m in enumerate(margins) if m < GREEDY_MARGIN), len(margins))
        else:
            k = len(ref_tokens)
        assert comp.token_ids[:k] == ref_tokens[:k], (
            f"{rid}: {comp.token_ids} != alone {ref_tokens} (first {k} tokens compared)")
        # Equal tokens alone say little: a random tiny model barely looks at its context.
        # The log-probs do move when attention reads the wrong K/V, so compare them too.
        got = [lp[t] for lp, t in zip(comp.logprobs[:k], comp.token_ids[:k])]
        assert got == pytest.approx(ref_logprobs[:k], abs=LOGPROB_ATOL), f"{rid}: log-probs differ from alone"
        if k == len(ref_tokens):
            assert comp.token_ids == ref_tokens and comp.finish_reason == ref_reason
        STATS["outputs equal to the mechanisms-off engine"] += 1
