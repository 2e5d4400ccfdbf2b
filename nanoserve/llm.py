"""LLM: generate completions for a list of prompts in one call (offline batch inference).

It checks every prompt, adds them all to an `LLMEngine` and steps until all
are done, with a progress bar. Continuous batching does the rest: requests of
different lengths finish at different steps and free their seats for the
others. A bad prompt anywhere in the batch is refused before any is queued,
and if stepping fails (or is interrupted) the call's requests are aborted, so
the next `generate` starts clean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from tqdm.auto import tqdm

from nanoserve import intake
from nanoserve.config import EngineConfig
from nanoserve.engine import LLMEngine
from nanoserve.errors import FieldError, SubscriberError
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.threads import apply_thread_policy


class LLM:
    def __init__(self, model: str = "tiny-llama", **config) -> None:
        """`config` takes any EngineConfig field, e.g. LLM("smollm2", block_size=16, num_blocks=512)."""
        apply_thread_policy()        # torch on the cores that are free (threads.py); OMP_NUM_THREADS wins
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._counter = 0

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of `prompts`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]                      # one prompt, as text or as token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        # Check every prompt before queueing any: a bad one leaves the engine as it was.
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                prepared.append(intake.prepare(self.engine, str(self._counter + i), prompt, params))
            except FieldError as e:
                raise FieldError(e.field, f"{e.text} (prompt {i} of {len(prompts)})") from None
        self._counter += len(prepared)
        for p in prepared:
            self.engine.enqueue(p)
        ids = [p.request.request_id for p in prepared]
        try:
            return self._run(ids, use_tqdm)
        except BaseException:
            # Whatever went wrong (a failed step, Ctrl-C), none of this call's requests stay behind
            # to be stepped by the next call.
            for rid in ids:
                if rid in self.engine.requests:
                    with contextlib.suppress(SubscriberError):   # (the abort is done even then)
                        self.engine.abort_request(rid)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request in `ids` has finished; their outputs, in order."""
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            num_tokens = 0
            while any(rid not in finished for rid in ids):
                result = self.engine.step()
                num_tokens += result.stats.num_decode_tokens + result.stats.num_prefill_tokens
                for out in result.outputs:
                    if out.finished and out.request_id in ids:
                        finished[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_per_s=f"{num_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
        return [finished[i] for i in ids]
