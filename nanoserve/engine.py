"""LLMEngine: requests in, one scheduler step at a time, outputs and events out.

    engine = LLMEngine(EngineConfig(model="tiny-llama"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished_requests():
        result = engine.step()

One `step()` is:

    drafts  = proposer.propose(...)     (speculative decoding only) guesses for decoding requests
    plan    = scheduler.schedule()      who runs, how many tokens each, which blocks
    batch   = runner.prepare(plan)      flat token row + slot mapping + block tables
    logits  = runner.run(batch)         one forward; attention reads K/V through block tables
    tokens  = sampler(logits, rows)     one token for every sequence whose chunk reached its end
              or verify(drafts)         (speculative) accepted drafts + one, rejected KV trimmed
    postprocess                         append tokens, detokenize, check stops, free finished

The engine owns request bookkeeping, stop conditions and events; it delegates
blocks to the pool, batching to the scheduler, tensors to the runner and
token choice to the sampler. `LLM` (in `llm.py`) wraps it for offline batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence as Seq

import torch

from nanoserve import events as ev
from nanoserve.block_pool import BlockPool
from nanoserve.config import EngineConfig
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.models.loader import LoadedModel, load_model
from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepResult, StepStats
from nanoserve.runner import ModelRunner, RunInput, kv_bytes_per_block
from nanoserve.sampler import SampledToken, Sampler, SamplingRow
from nanoserve.spec_decode import Drafts, build_proposer, sampling_rows, verify
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence, SequenceStatus
from nanoserve.trace import EventBus, synced_event

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prepare_backend(config: EngineConfig) -> str:
    """Pick the attention backend; Triton on a CPU runs under its interpreter (set before import)."""
    backend = config.resolved_backend()
    if backend == "triton":
        import importlib.util
        import os

        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' needs triton: pip install triton")
        if not config.device.startswith("cuda"):
            os.environ.setdefault("TRITON_INTERPRET", "1")
            import triton.language as tl

            # The interpreter must be on before triton is first imported (transformers imports it),
            # or triton's own helpers stay compiled-only.
            if type(tl.zeros).__name__ != "InterpretedFunction":
                raise ValueError("attention_backend='triton' on CPU runs under the Triton interpreter: "
                                 "start Python with TRITON_INTERPRET=1 in the environment")
    return backend


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, **kwargs) -> None:
        """Build an engine from a config (or its fields as keyword arguments).

        `loaded` reuses an already loaded model (e.g. several engines in a test).
        """
        self.config = config = config or EngineConfig(**kwargs)
        dtype = DTYPES[config.dtype]
        self.loaded = loaded or load_model(config.model, dtype, config.device, config.seed)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_id = self.loaded.eos_token_id
        model = self.loaded.model
        config.resolve(model.max_positions, kv_bytes_per_block(model, config.block_size, dtype))
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.bus = EventBus()
        self.scheduler = Scheduler(config, self.pool, self._emit)
        self.backend = prepare_backend(config)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, dtype, torch.device(config.device),
                                  self.backend)
        self.sampler = Sampler()
        self.proposer = build_proposer(config, self.loaded, dtype)   # None unless speculative decoding is on
        self.vocab_size = model.config.vocab_size
        self.requests: dict[str, Sequence] = {}      # unfinished requests by id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.step_count = 0
        self._events: list[ev.Event] = []            # events since the last step() returned
        self._rng = torch.Generator().manual_seed(config.seed)   # seeds the RNG of unseeded requests
        # Speculative decoding totals over the engine's life: drafted, accepted, tokens, sampling forwards.
        self._spec_totals = {"drafted": 0, "accepted": 0, "tokens": 0, "forwards": 0}

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError (and changes nothing) on bad input."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {max_len}, "
                             "which leaves no room to generate")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        seq = Sequence(request_id, text, token_ids, params, generator=torch.Generator().manual_seed(seed))
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.logprobs is not None:
            seq.logprobs = []
        self.requests[request_id] = seq
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.scheduler.add(seq)
        self._emit(ev.RequestAdded(self.step_count, request_id, text or "", len(token_ids), params.max_tokens))

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer: pass the prompt as token ids")
            token_ids = self.tokenizer(prompt).input_ids
            if not token_ids:
                raise ValueError("prompt is empty after tokenization")
            return prompt, list(token_ids)
        token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return None, token_ids

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request now and free all its blocks. Raises KeyError for an unknown id."""
        if request_id not in self.requests:
            raise KeyError(f"no unfinished request {request_id!r}")
        seq = self.requests[request_id]
        self._emit(ev.RequestAborted(self.step_count, request_id))
        return self._finish(seq, SequenceStatus.FINISHED_ABORTED, delta="")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> StepResult:
        t0 = time.perf_counter()
        self.step_count += 1
        self.scheduler.step = self.step_count
        self._emit(ev.StepStarted(self.step_count, len(self.scheduler.waiting), len(self.scheduler.running)))
        drafts = self._propose() if self.proposer else Drafts()
        # Token counts when the drafts were made: what a rollback returns the draft cache to.
        drafted_at = {rid: self.requests[rid].num_tokens for rid in drafts.tokens}
        plan = self.scheduler.schedule(drafts.tokens)
        outputs: dict[str, RequestOutput] = {}
        for seq in plan.failed:
            outputs[seq.request_id] = self._finish(seq, seq.status, delta="")
        for seq in plan.preempted:
            if self.proposer:
                self.proposer.release(seq.request_id)   # its draft KV goes with its target KV
        num_drafted, num_accepted = self._forward(plan, drafts, outputs) if plan.chunks else (0, 0)
        if self.proposer:   # drafts that were proposed but not run (no budget left) roll back too
            ran = {c.seq.request_id for c in plan.chunks if c.draft_token_ids}
            for rid in drafts.tokens.keys() - ran:
                if rid in self.requests:
                    self.proposer.accepted(self.requests[rid], drafted_at[rid], 0)
        prefill = sum(c.num_tokens for c in plan.chunks if c.is_prefill)
        stats = StepStats(
            step=self.step_count, num_seqs=len(plan.chunks), num_prefill_tokens=prefill,
            num_decode_tokens=plan.num_tokens - prefill, num_preempted=len(plan.preempted),
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_free_blocks=self.pool.num_free_blocks, num_blocks=self.pool.num_blocks,
            duration_s=time.perf_counter() - t0, num_drafted=num_drafted, num_accepted=num_accepted,
        )
        self._emit(ev.StepFinished(self.step_count, stats.num_seqs, prefill, stats.num_decode_tokens,
                                   stats.num_free_blocks, stats.duration_s))
        events, self._events = self._events, []
        return StepResult(list(outputs.values()), events, stats)

    def _forward(self, plan, drafts: Drafts, outputs: dict[str, RequestOutput]) -> tuple[int, int]:
        """Run the model on the plan, choose tokens, postprocess. Returns (drafted, accepted)."""
        inputs = [RunInput(c.token_ids(), c.start, c.seq.block_table,
                           num_logits=1 + len(c.draft_token_ids) if c.samples else 0) for c in plan.chunks]
        logits = self.runner.run(self.runner.prepare(inputs))   # [rows, vocab], in chunk order
        self.scheduler.update(plan)                              # the KV of every real token is written
        # Split the logits rows: plain chunks sample one token together, drafted ones verify.
        plain, spec, row = [], [], 0
        for c, x in zip(plan.chunks, inputs):
            if x.num_logits:
                (spec if c.draft_token_ids else plain).append((c, row))
                row += x.num_logits
        if plain:
            rows = [SamplingRow(c.seq.params, c.seq.prompt_token_ids, c.seq.output_token_ids,
                                c.seq.generator, self.eos_token_id) for c, _ in plain]
            sampled = self.sampler(logits[[r for _, r in plain]], rows)
            for (c, _), token in zip(plain, sampled):
                outputs[c.seq.request_id] = self._append_tokens(c.seq, [token])
        drafted = accepted = 0
        for c, r in spec:
            tokens = self._verify(c, logits[r : r + 1 + len(c.draft_token_ids)], drafts)
            drafted += len(c.draft_token_ids)
            accepted += len(tokens) - 1
            outputs[c.seq.request_id] = self._append_tokens(c.seq, tokens)
        self._spec_totals["drafted"] += drafted
        self._spec_totals["accepted"] += accepted
        return drafted, accepted

    # -- speculative decoding ---------------------------------------------------------------

    def spec_stats(self) -> dict:
        """Speculative decoding over the engine's life: acceptance rate and tokens per target forward."""
        t = self._spec_totals
        return {
            "num_drafted": t["drafted"], "num_accepted": t["accepted"],
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
            "tokens_per_forward": t["tokens"] / t["forwards"] if t["forwards"] else None,
        }

    def _propose(self) -> Drafts:
        """Ask the proposer for drafts for every running request that is decoding."""
        k, max_len = self.config.num_speculative_tokens, self.config.max_model_len
        seqs = [s for s in self.scheduler.running if not s.is_prefilling]
        # Never draft past max_tokens or max_model_len: one step emits up to k + 1 tokens.
        limits = {s.request_id: max(0, min(k, s.params.max_tokens - s.num_output_tokens - 1,
                                           max_len - s.num_tokens - 1)) for s in seqs}
        drafts = self.proposer.propose(seqs, limits)
        for rid, tokens in drafts.tokens.items():
            self._emit(ev.DraftProposed(self.step_count, rid, self.proposer.method, tuple(tokens)))
        return drafts

    def _verify(self, chunk, logits: torch.Tensor, drafts: Drafts) -> list[SampledToken]:
        """Exact acceptance of a chunk's drafts; roll back the KV of the rejected ones."""
        seq, draft = chunk.seq, chunk.draft_token_ids
        n = len(draft)
        rows = sampling_rows(seq, draft, self.eos_token_id, n + 1)
        q = drafts.q.get(seq.request_id)
        tokens, accepted = verify(self.sampler.probs(logits, rows), draft, q[:n] if q is not None else None,
                                  seq.params.greedy, seq.generator)
        num_tokens_before = seq.num_tokens
        seq.num_drafted += n
        seq.num_accepted += accepted
        # The last real token and the accepted drafts have valid KV; the rejected positions do not.
        seq.num_computed_tokens += accepted
        freed = self.scheduler.trim(seq)
        self.proposer.accepted(seq, num_tokens_before, accepted)
        self._emit(ev.DraftVerified(self.step_count, seq.request_id, n, accepted, accepted if accepted < n else -1,
                                    tokens[-1], accepted == n))
        self._emit(ev.KVTrimmed(self.step_count, seq.request_id, seq.num_computed_tokens, n - accepted, freed))
        return self.sampler.report(logits[: len(tokens)], tokens, rows[: len(tokens)])

    def _append_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> RequestOutput:
        """Postprocess this step's tokens (one, or several with speculation) until one finishes the request."""
        seq.num_sampling_steps += 1
        self._spec_totals["forwards"] += 1
        delta = ""
        for token in tokens:
            self._spec_totals["tokens"] += 1
            status, text = self._append_token(seq, token)
            delta += text
            if status is not None:
                return self._finish(seq, status, delta)
        return self._output(seq, delta)

    def _append_token(self, seq: Sequence, token: SampledToken) -> tuple[SequenceStatus | None, str]:
        """One token: text, logprobs, stop conditions. Returns (finished status or None, new text)."""
        params = seq.params
        seq.output_token_ids.append(token.token_id)
        seq.cumulative_logprob += token.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(token.top_logprobs or {token.token_id: token.logprob})
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        n = seq.num_output_tokens
        may_stop = n >= params.min_tokens               # nothing stops a request before min_tokens
        delta, hit_stop_string = self.detokenizers[seq.request_id].update(seq.output_token_ids, may_stop)
        status = None
        is_eos = token.token_id == self.eos_token_id and not params.ignore_eos
        if may_stop and (is_eos or token.token_id in params.stop_token_ids or hit_stop_string):
            status = SequenceStatus.FINISHED_STOPPED
        elif n >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:   # release the text held back in case it started a stop string
            delta += self.detokenizers[seq.request_id].flush()
        self._emit(ev.TokenSampled(self.step_count, seq.request_id, token.token_id, delta, token.logprob))
        seq.output_text += delta
        return status, delta

    def _finish(self, seq: Sequence, status: SequenceStatus, delta: str) -> RequestOutput:
        """Close a request: free its blocks, forget it, say so."""
        self.detokenizers.pop(seq.request_id)
        if self.proposer:
            self.proposer.release(seq.request_id)
        if not seq.is_finished:   # (the scheduler already closed requests it failed)
            self.scheduler.finish(seq, status)
        self.requests.pop(seq.request_id)
        self._emit(ev.RequestFinished(self.step_count, seq.request_id, seq.status.finish_reason,
                                      seq.num_output_tokens, seq.error or ""))
        return self._output(seq, delta)

    def _output(self, seq: Sequence, delta: str) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.status.finish_reason, delta=delta, error=seq.error,
        )
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished,
                             RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time,
                                            seq.num_sampling_steps, seq.num_drafted, seq.num_accepted))

    # -- watching ------------------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        self._events.append(event)
        if self.bus.active:
            self.bus.publish(event)

    def subscribe(self, callback: Callable[[ev.Event], None]) -> Callable[[], None]:
        """Call `callback` with every event from now on, first an EngineSynced; returns unsubscribe."""
        unsubscribe = self.bus.subscribe(callback)
        callback(self._synced())
        return unsubscribe

    def _synced(self) -> ev.EngineSynced:
        return synced_event(self.snapshot())

    def snapshot(self) -> dict:
        """The engine's state as plain data: pool, block tables, queues."""
        def view(seq: Sequence) -> dict:
            return {
                "request_id": seq.request_id, "status": seq.status.value, "prompt": seq.prompt or "",
                "num_prompt_tokens": seq.num_prompt_tokens, "output_text": seq.output_text,
                "num_output_tokens": seq.num_output_tokens, "num_computed_tokens": seq.num_computed_tokens,
                "block_table": list(seq.block_table), "max_tokens": seq.params.max_tokens,
            }
        return {
            "step": self.step_count,
            "model": self.config.model,
            "pool": self.pool.snapshot(),
            "waiting": [s.request_id for s in self.scheduler.waiting],
            "running": [s.request_id for s in self.scheduler.running],
            "requests": [view(s) for s in self.requests.values()],
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        self.scheduler.check_invariants()
        if self.proposer:
            self.proposer.check_invariants()
        live = {s.request_id for s in self.scheduler.running} | {s.request_id for s in self.scheduler.waiting}
        assert live == set(self.requests), f"queues {sorted(live)} != requests {sorted(self.requests)}"
        if not self.requests:
            assert self.pool.num_used_blocks == 0, f"{self.pool.num_used_blocks} blocks leaked with no requests"

    def __rich__(self):
        from nanoserve.viz.repl import render_engine
        return render_engine(self)

    def __repr__(self) -> str:
        from nanoserve.viz.repl import to_text
        return to_text(self)

    def _repr_html_(self) -> str:
        """Jupyter: the rich panel, and the block tables drawn by Graphviz when `dot` is installed."""
        from nanoserve.viz.graphviz import engine_svg
        from nanoserve.viz.repl import to_html

        svg = engine_svg(self)
        return to_html(self) + (svg or "")

    def _repr_svg_(self) -> str | None:
        from nanoserve.viz.graphviz import engine_svg
        return engine_svg(self)
