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

import copy

from nanoserve import beam_search, engine_state, events as ev, spec_decode
from nanoserve.attention import prepare_backend
from nanoserve.block_pool import BlockPool
from nanoserve.config import EngineConfig
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.models.loader import LoadedModel, load_model
from nanoserve.kv_manager import KVManager
from nanoserve.outputs import RequestOutput, StepResult, StepStats
from nanoserve.radix_cache import RadixCache
from nanoserve.request import Request
from nanoserve.runner import ModelRunner, RunInput, kv_bytes_per_block
from nanoserve.sampler import SampledToken, Sampler, SamplingRow
from nanoserve.spec_decode import Drafts, build_proposer
from nanoserve.sampling_params import SamplingParams, to_pairs
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence, SequenceStatus
from nanoserve.trace import EventBus, synced_event

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        # The radix prefix cache (None when off) and the CPU pool for swap preemption (None without swap space).
        self.radix = RadixCache(self.pool, self._emit, self._span_text) if config.enable_prefix_caching else None
        self.cpu_pool = BlockPool(config.num_cpu_blocks, config.block_size) if config.num_cpu_blocks else None
        self.kv = KVManager(self.pool, self.radix, self.cpu_pool, self._emit)
        self.scheduler = Scheduler(config, self.kv, self._emit)
        self.backend = prepare_backend(config)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, dtype, torch.device(config.device),
                                  self.backend, fast_paths=config.fast_paths)
        if self.cpu_pool is not None:
            self.runner.allocate_swap(config.num_cpu_blocks)
        self.sampler = Sampler()
        self.proposer = build_proposer(config, self.loaded, dtype)   # None unless speculative decoding is on
        self.vocab_size = model.config.vocab_size
        self.requests: dict[str, Sequence] = {}      # unfinished sequences by id (a request's first has its id)
        self.groups: dict[str, Request] = {}         # unfinished requests by id, with all their sequences
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}   # by sequence id
        self._finished_ids: set[str] = set()         # for clear errors about requests that are over
        self._deltas: dict[str, str] = {}            # text each sequence added in the current step
        self.step_count = 0
        self._events: list[ev.Event] = []            # events since the last step() returned
        self._rng = torch.Generator().manual_seed(config.seed)   # seeds the RNG of unseeded requests
        # Speculative decoding totals over the engine's life: drafted, accepted, tokens, sampling forwards.
        self._spec_totals = {"drafted": 0, "accepted": 0, "tokens": 0, "forwards": 0}

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. Raises ValueError (and changes nothing) on bad input.

        `priority` matters with preemption_policy="priority": the lowest is preempted first.
        """
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {max_len}, "
                             "which leaves no room to generate")
        if params.num_seqs > self.config.max_num_seqs:
            raise ValueError(f"{'beam_width' if params.use_beam_search else 'n'}={params.num_seqs} sequences "
                             f"cannot run together with max_num_seqs={self.config.max_num_seqs}")
        if params.use_beam_search:
            worst = params.num_seqs * self.pool.blocks_needed(0, min(max_len, len(token_ids) + params.max_tokens))
            if worst > self.pool.num_blocks:
                raise ValueError(f"beam search with {params.num_seqs} beams may need {worst} blocks; "
                                 f"the pool has {self.pool.num_blocks}")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        seq = Sequence(request_id, text, token_ids, params, generator=torch.Generator().manual_seed(seed),
                       priority=priority, seats=params.num_seqs)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.logprobs is not None:
            seq.logprobs = []
        self.groups[request_id] = Request(request_id, params, seed, [seq])
        self._finished_ids.discard(request_id)
        self.requests[request_id] = seq
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.scheduler.add(seq)
        shown = engine_state.prompt_text(text, token_ids, self.tokenizer)   # token ids: their text
        self._emit(ev.RequestAdded(self.step_count, request_id, shown, len(token_ids), params.max_tokens,
                                   tuple(token_ids) if text is None else (), to_pairs(params, seed), priority))

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
        """Stop a request (all its sequences) now and free their blocks.

        Takes a request id, or one sequence's id ("r1.2") to stop just that fork.
        Raises KeyError for an unknown id.
        """
        if request_id in self.groups:
            seqs = self.groups[request_id].live
        elif request_id in self.requests:
            seqs = [self.requests[request_id]]
        else:
            raise KeyError(self._unknown(request_id))
        out = None
        for seq in seqs:
            self._emit(ev.RequestAborted(self.step_count, seq.request_id))
            out = self._finish(seq, SequenceStatus.FINISHED_ABORTED, delta="")
        return out

    def _unknown(self, request_id: str) -> str:
        if request_id in self._finished_ids:
            return f"request {request_id!r} has already finished"
        return f"no unfinished request {request_id!r}"

    def fork(self, request_id: str, seed: int | None = None) -> str:
        """Fork a running sequence at its current position; returns the new sequence's id.

        The fork joins the same request as one more completion. It shares every
        block of its parent (nothing is copied until one of them writes into a
        shared, partly filled block) and continues with its own random stream,
        seeded by `seed` (default: a seed drawn from the engine's RNG).
        Raises KeyError for an unknown or finished request, ValueError when the
        sequence cannot be forked now; the engine is unchanged then.
        """
        seq = self.requests.get(request_id)
        if seq is None:
            raise KeyError(self._unknown(request_id))
        if seq.params.use_beam_search:
            raise ValueError(f"{request_id!r} is a beam of a beam search, which forks its beams itself")
        if seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens == 0:
            state = "is still computing its prompt" if seq.status is SequenceStatus.RUNNING else f"is {seq.status.value}"
            raise ValueError(f"{request_id!r} {state}: only a running request that has started generating "
                             "can be forked")
        if self.scheduler.seats_used + 1 > self.config.max_num_seqs:
            raise ValueError(f"no free seat for a fork: max_num_seqs={self.config.max_num_seqs} sequences "
                             "already run")
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._rng))
        return self._fork_seq(seq, seed).request_id

    def _fork_seq(self, parent: Sequence, seed: int) -> Sequence:
        """A new running sequence of the same request, sharing `parent`'s tokens, text and blocks."""
        group = self.groups[parent.group_id]
        child_id = group.fork_id()
        while child_id in self.requests or child_id in self.groups:   # a user's request may have this id
            child_id = group.fork_id()
        child = parent.fork(child_id, torch.Generator().manual_seed(seed))
        self.kv.fork(parent, child, seed)
        self.scheduler.running.append(child)
        group.seqs.append(child)
        self.requests[child_id] = child
        self.detokenizers[child_id] = copy.copy(self.detokenizers[parent.request_id])   # plain state: a shallow copy
        return child

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> StepResult:
        t0 = time.perf_counter()
        self.step_count += 1
        self.scheduler.step = self.step_count
        self._deltas = {}
        self._emit(ev.StepStarted(self.step_count, len(self.scheduler.waiting), len(self.scheduler.running)))
        drafts = spec_decode.propose(self) if self.proposer else Drafts()
        # Token counts when the drafts were made: what a rollback returns the draft cache to.
        drafted_at = {rid: self.requests[rid].num_tokens for rid in drafts.tokens}
        plan = self.scheduler.schedule(drafts.tokens)
        # Block moves the plan needs before the forward: swap out first (those device blocks may be
        # handed to someone else in this very step), then swap in, then copy-on-write copies.
        self.runner.swap_out(plan.swap_out)
        self.runner.swap_in(plan.swap_in)
        self.runner.copy_blocks(plan.copies)
        outputs: dict[str, RequestOutput] = {}
        for seq in plan.failed:
            outputs[seq.group_id] = self._finish(seq, seq.status, delta="")
        for seq in plan.preempted:
            if self.proposer:
                self.proposer.release(seq.request_id)   # its draft KV goes with its target KV
        num_drafted, num_accepted = self._forward(plan, drafts, outputs) if plan.chunks else (0, 0)
        if self.proposer:   # drafts that were proposed but not run (no budget left) roll back too
            ran = {c.seq.request_id for c in plan.chunks if c.draft_token_ids}
            for rid in drafts.tokens.keys() - ran:
                if rid in self.requests:
                    self.proposer.accepted(self.requests[rid], drafted_at[rid], 0)
        self.scheduler.cache_blocks()      # blocks that filled this step join the prefix cache
        prefill = sum(c.num_tokens for c in plan.chunks if c.is_prefill)
        stats = StepStats(
            step=self.step_count, num_seqs=len(plan.chunks), num_prefill_tokens=prefill,
            num_decode_tokens=plan.num_tokens - prefill, num_preempted=len(plan.preempted),
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_free_blocks=self.pool.num_free_blocks, num_blocks=self.pool.num_blocks,
            duration_s=time.perf_counter() - t0, num_drafted=num_drafted, num_accepted=num_accepted,
            num_swapped=len(self.scheduler.swapped),
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
        # Split the logits rows: plain chunks sample one token together, drafted ones verify,
        # beams wait until every beam of their request has its scores.
        plain, spec, beams, row = [], [], [], 0
        for c, x in zip(plan.chunks, inputs):
            if x.num_logits:
                if c.draft_token_ids:
                    spec.append((c, row))
                else:
                    (beams if c.seq.params.use_beam_search else plain).append((c.seq, row))
                row += x.num_logits
        if plain:
            self._sample(plain, logits, outputs)
        drafted = accepted = 0
        for c, r in spec:
            tokens = spec_decode.verify_chunk(self, c, logits[r : r + 1 + len(c.draft_token_ids)], drafts)
            drafted += len(c.draft_token_ids)
            accepted += len(tokens) - 1
            outputs[c.seq.group_id] = self._append_tokens(c.seq, tokens)
        self._spec_totals["drafted"] += drafted
        self._spec_totals["accepted"] += accepted
        for seq, r in beams:
            seq.beam_logprobs = beam_search.next_logprobs(logits[r], seq, self.eos_token_id)
        for group_id in dict.fromkeys(seq.group_id for seq, _ in beams):
            beam_search.step(self, self.groups[group_id], outputs)
        return drafted, accepted

    def _sample(self, plain: list[tuple[Sequence, int]], logits: torch.Tensor,
                outputs: dict[str, RequestOutput]) -> None:
        """One token for each (sequence, logits row). A request with n > 1 forks here, when its
        prompt is done: the n sequences share the prompt's blocks and sample from the same row."""
        pairs = []
        for seq, r in plain:
            pairs.append((seq, r))
            group = self.groups[seq.group_id]
            if group.needs_fork:
                group.forked, seq.seats = True, 1
                pairs += [(self._fork_seq(seq, (group.seed * 1_000_003 + i) % 2**62), r)
                          for i in range(1, group.params.n)]
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, self.eos_token_id)
                for s, _ in pairs]
        sampled = self.sampler(logits[[r for _, r in pairs]], rows)
        for (seq, _), token in zip(pairs, sampled):
            outputs[seq.group_id] = self._append_tokens(seq, [token])

    def _prune(self, seq: Sequence) -> RequestOutput:
        """Drop a beam: free its blocks, forget it (it is no completion of the request)."""
        self._emit(ev.BeamPruned(self.step_count, seq.request_id))
        seq.pruned = True
        self.groups[seq.group_id].seqs.remove(seq)
        return self._finish(seq, SequenceStatus.FINISHED_ABORTED, delta="", quiet=True)

    # -- speculative decoding ---------------------------------------------------------------

    def spec_stats(self) -> dict:
        """Speculative decoding over the engine's life: acceptance rate and tokens per target forward."""
        t = self._spec_totals
        return {
            "num_drafted": t["drafted"], "num_accepted": t["accepted"],
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
            "tokens_per_forward": t["tokens"] / t["forwards"] if t["forwards"] else None,
        }

    def _append_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> RequestOutput:
        """Postprocess this step's tokens (one, or several with speculation) until one finishes the sequence."""
        seq.num_sampling_steps += 1
        self._spec_totals["forwards"] += 1
        delta = ""
        for token in tokens:
            self._spec_totals["tokens"] += 1
            status, text = self._append_token(seq, token)
            delta += text
            if status is not None:
                return self._finish(seq, status, delta)
        self._deltas[seq.request_id] = self._deltas.get(seq.request_id, "") + delta
        return self.groups[seq.group_id].output(self._deltas)

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

    def _finish(self, seq: Sequence, status: SequenceStatus, delta: str, quiet: bool = False) -> RequestOutput:
        """Close a sequence: free its blocks, forget it, say so; the request ends with its last sequence."""
        self._deltas[seq.request_id] = self._deltas.get(seq.request_id, "") + delta
        self.detokenizers.pop(seq.request_id)
        if self.proposer:
            self.proposer.release(seq.request_id)
        if not seq.is_finished:   # (the scheduler already closed sequences it failed)
            self.scheduler.finish(seq, status)
        self.requests.pop(seq.request_id)
        if not quiet:             # (a pruned beam is no completion: BeamPruned said it all)
            self._emit(ev.RequestFinished(self.step_count, seq.request_id, seq.status.finish_reason,
                                          seq.num_output_tokens, seq.error or ""))
        group = self.groups[seq.group_id]
        if group.finished:
            del self.groups[group.request_id]
            self._finished_ids.add(group.request_id)
        return group.output(self._deltas)

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
        """The engine's state as plain data: pool, block tables, queues, radix tree, CPU pool."""
        return engine_state.snapshot(self)

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        engine_state.check_invariants(self)

    # -- prefix cache --------------------------------------------------------------------

    def _span_text(self, tokens: list[int]) -> str:
        """A radix node's tokens as text, for events and views."""
        if self.tokenizer is None:
            return " ".join(map(str, tokens))
        return self.tokenizer.decode(tokens)

    def prefix_cache_stats(self) -> dict:
        """Over the engine's life: tokens looked up at admission, tokens a hit skipped, and their ratio."""
        looked, hit = self.kv.num_lookup_tokens, self.kv.num_hit_tokens
        return {"num_lookup_tokens": looked, "num_hit_tokens": hit, "hit_rate": hit / looked if looked else None,
                "num_cached_blocks": self.radix.num_cached_blocks if self.radix else 0}

    def clear_prefix_cache(self) -> int:
        """Evict every cached block nobody is using; returns how many went back to the free queue."""
        return self.radix.clear() if self.radix else 0

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
