"""LLMEngine: requests in, one scheduler step at a time, outputs and events out.

    engine = LLMEngine(EngineConfig(model="tiny-llama"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished_requests():
        result = engine.step()

One `step()` has three phases:

    plan     drafts = proposer.propose(...)   (speculative decoding only) guesses for decoding requests
             plan   = scheduler.schedule()    who runs, how many tokens each, which blocks
    compute  runner: block copies and swaps, then one forward over the flat token row
             (attention reads K/V through block tables), then the token choice
             (token_choice.py: sample, or verify drafts, or beam scores)
    commit   commit.py applies the choices to the request table (request_table.py): append tokens,
             detokenize, check stops, fork, free finished; then full blocks join the prefix cache

A step is all or nothing, by construction rather than by luck:

* *plan* is bookkeeping the scheduler does every step (the state machine
  tests check it after every operation); it allocates blocks but computes
  nothing. (Raising there would be a bookkeeping bug: nothing undoes it.)
* *compute* changes no bookkeeping at all: it only writes KV into the blocks
  the plan gave and advances the requests' RNGs. If it raises (out of memory,
  a kernel error, Ctrl-C; the draft model's forward counts too),
  `step_rollback.py` undoes the plan (RNGs restored, uncomputed blocks given
  back, draft caches dropped) and `step()` raises `StepFailed` naming the
  requests and the cause; they keep their tokens and the next step runs them
  again.
* *commit* is per request: if one request's logits are not a distribution
  (NaN) or its postprocessing raises, that request alone is finished with
  finish_reason "abort" and an `error`, its blocks released; the others go on.
* A subscriber that raises cannot interrupt any of this: its exception is
  held until the operation is complete, then raised as `SubscriberError`.

`add_request`, `abort_request` and `fork` check everything that can fail
before they change anything (`intake.py` builds a request without touching
the engine). The engine builds the parts and conducts the step; it owns the
step number and the event stream. The live requests and the verbs that apply
tokens to them belong to the `RequestTable` (`engine.table`; `engine.requests`
and `engine.sequences` read it), blocks to the KV manager, batching to the
scheduler, tensors to the runner, token choice to the sampler. `LLM` (in
`llm.py`) wraps it for offline batches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NoReturn

import torch

from nanoserve import engine_state, intake, prompt_logprobs, spec_decode, step_rollback
from nanoserve import events as ev
from nanoserve import validation as v
from nanoserve.commit import commit
from nanoserve.components import Components
from nanoserve.config import EngineConfig
from nanoserve.display import Displayable
from nanoserve.errors import SubscriberError
from nanoserve.implementation import choose
from nanoserve.kv_groups import make_groups
from nanoserve.models.loader import LoadedModel, load_model
from nanoserve.outputs import RequestOutput, StepResult, StepStats
from nanoserve.request import Request
from nanoserve.request_table import RequestTable
from nanoserve.runner import ModelRunner, RunInput, kv_budget
from nanoserve.sampler import Sampler
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import StepPlan
from nanoserve.sequence import Sequence, SequenceStatus
from nanoserve.spec_decode import Drafts, build_proposer
from nanoserve.token_choice import Choice, choose_tokens
from nanoserve.trace import EventBus, synced_event

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine(Displayable):
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None,
                 workers=None, components: Components | None = None, **kwargs) -> None:
        """Build an engine from a config (or its fields as keyword arguments).

        `loaded` reuses an already loaded model (e.g. several engines in a test); `workers`, a
        started `distributed.WorkerGroup`, the worker processes of tensor parallelism.
        `components` names the classes the engine builds its parts from (`components.py`):
        the engine's own by default, a student's in `nanoserve lab`.
        """
        if components is not None and not isinstance(components, Components):
            raise TypeError(f"components must be a Components, got {type(components).__name__}")
        self.components = parts = components or Components()
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        # A private copy, checked again: resolve() fills it in, the caller's object stays as it was.
        self.config = config = dataclasses.replace(config) if config is not None else EngineConfig(**kwargs)
        dtype = DTYPES[config.dtype]
        self.loaded = loaded or load_model(config.model, dtype, config.device, config.seed)
        self.tokenizer = self.loaded.tokenizer
        model = self.loaded.model
        config.resolve(model.max_positions, *kv_budget(model, config, dtype))   # FieldError before any allocation
        # KV cache groups (kv_groups.py): one group of every layer, or one per kind of attention. A block of
        # the pool is `block_size` tokens of one group's layers, so the pool holds num_blocks * groups of
        # them: the bytes num_blocks whole-model blocks take.
        self.kv_groups = make_groups(list(getattr(model, "sliding_windows", None) or [None] * model.num_layers),
                                     config.kv_window_freeing and config.tensor_parallel_size == 1)
        self.pool = parts.block_pool(config.num_blocks * len(self.kv_groups), config.block_size)
        self.bus = EventBus(hold_errors=True)   # a raising viewer never stops a step half way
        self.clock = ev.StepClock()             # the step number: the engine advances it, its parts read it
        # The radix prefix cache (None when off) and the CPU pool for swap preemption (None without swap space).
        self.radix = parts.radix_cache(self.pool, self.emit, self._span_text, clock=self.clock) \
            if config.enable_prefix_caching else None
        self.cpu_pool = parts.block_pool(config.num_cpu_blocks * len(self.kv_groups), config.block_size) \
            if config.num_cpu_blocks else None
        self.kv = parts.kv_manager(self.pool, self.radix, self.cpu_pool, self.emit, clock=self.clock,
                                   **({"groups": self.kv_groups} if len(self.kv_groups) > 1 else {}))
        self.scheduler = parts.scheduler(config, self.kv, self.emit, clock=self.clock)
        backend = choose(config)              # which code runs: "auto" turned into names, once (implementation.py)
        if config.tensor_parallel_size > 1:   # the model split over processes (distributed/tensor_parallel.py)
            from nanoserve.distributed.tensor_parallel import TensorParallelRunner
            self.runner = TensorParallelRunner(model, config, backend, self.emit, lambda: self.step_count, workers)
        else:
            self.runner = ModelRunner.from_config(model, config, dtype, backend, parts.attention_backend,
                                                  groups=self.kv_groups)
        # What computes a step, as it actually runs: the model class, attention backend and matmul, and why
        # a faster part did not run (runner.Implementation; the snapshot, the TUI header and --stats say it).
        self.implementation = self.runner.implementation
        if self.cpu_pool is not None:
            self.runner.allocate_swap(self.cpu_pool.num_blocks)
        self.sampler = Sampler()
        self.proposer = build_proposer(config, self.loaded, dtype)   # None unless speculative decoding is on
        self.vocab_size = model.config.vocab_size
        # The live requests, their sequences and detokenizers; the commit phase's verbs (request_table.py).
        self.table: RequestTable = parts.request_table(config, self.scheduler, self.kv, self.proposer, self.tokenizer,
                                                       self.loaded.eos_token_id, self.emit, clock=self.clock)
        self._events: list[ev.Event] = []            # events since the last step() returned
        self._rng = torch.Generator().manual_seed(config.seed)   # seeds the RNG of unseeded requests

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id, with all their sequences (the table's; read them, change them through it)."""
        return self.table.requests

    @property
    def sequences(self) -> dict[str, Sequence]:
        """Unfinished sequences by id (a request's first has its id)."""
        return self.table.sequences

    @property
    def eos_token_id(self) -> int | None:
        """The model's end-of-sequence token (the table's: one of its stop conditions)."""
        return self.table.eos_token_id

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. Raises FieldError (a ValueError naming the argument or field) and
        changes nothing on bad input.

        `priority` matters with preemption_policy="priority": the lowest is preempted first.
        """
        self.enqueue(intake.prepare(self, request_id, prompt, params, arrival_time, priority))
        self._raise_subscriber_errors()

    def enqueue(self, prepared: intake.PreparedRequest) -> None:
        """Queue a request `intake.prepare` built and checked (nothing here can fail)."""
        seq, request = prepared.seq, prepared.request
        if request.seed is None:   # unseeded: a seed from the engine's RNG, so runs are reproducible
            request.seed = int(torch.randint(2**62, (1,), generator=self._rng))
            seq.generator = torch.Generator().manual_seed(request.seed)
        self.table.add(prepared)

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request (all its sequences) now and free their blocks.

        Takes a request id, or one sequence's id ("r1.2") to stop just that fork.
        Raises KeyError for an unknown id.
        """
        out = self.table.abort(v.text("request_id", request_id))
        self._raise_subscriber_errors(out)
        return out

    def fork(self, seq_id: str, seed: int | None = None) -> str:
        """Fork a running sequence at its current position; returns the new sequence's id.

        The fork joins the same request as one more completion. It shares every
        block of its parent (nothing is copied until one of them writes into a
        shared, partly filled block) and continues with its own random stream,
        seeded by `seed` (default: a seed drawn from the engine's RNG; a replay
        passes the one the first run drew). Raises KeyError for an unknown or finished sequence, ValueError when the
        sequence cannot be forked now; the engine is unchanged then.
        """
        seq = self.sequences.get(v.text("seq_id", seq_id))
        seed = v.optional_integer("seed", seed, minimum=0, maximum=2**64 - 1)
        if seq is None:
            raise KeyError(self.table.unknown(seq_id))
        if seq.params.use_beam_search:
            raise ValueError(f"{seq_id!r} is a beam of a beam search, which forks its beams itself")
        if seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens == 0:
            state = "is still computing its prompt" if seq.status is SequenceStatus.RUNNING else f"is {seq.status.value}"
            raise ValueError(f"{seq_id!r} {state}: only a running request that has started generating "
                             "can be forked")
        if seq.seats > 1:   # (its first token comes with its n - 1 forks: forking it now would double them)
            raise ValueError(f"{seq_id!r} has not forked its n={seq.params.n} completions yet")
        if self.table.free_seats() < 1:
            raise ValueError(f"no free seat for a fork: max_num_seqs={self.config.max_num_seqs} sequences "
                             "already run")
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._rng))
        child_id = self.table.fork(seq, torch.Generator().manual_seed(seed), seed).seq_id
        self._raise_subscriber_errors(child_id)
        return child_id

    def shutdown(self) -> None:
        """Stop the worker processes of a distributed engine (nothing to do for one process)."""
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def step_count(self) -> int:
        """Steps run so far (failed ones included): the number events are stamped with."""
        return self.clock.step

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> StepResult:
        """Plan, compute, commit one step (all or nothing: see the module docstring)."""
        t0 = time.perf_counter()
        self.clock.step += 1
        self.table.begin_step()
        outputs = {}
        self.emit(ev.StepStarted(self.step_count, len(self.scheduler.waiting), len(self.scheduler.running)))
        # What a failed compute phase must undo: the RNGs drafting and sampling draw from, and whether
        # the plan's block moves were carried out (step_rollback.py).
        rollback = step_rollback.Rollback(self.scheduler, self.kv, self.proposer, self.emit, self.clock)
        try:
            drafts = self._propose()                  # speculative decoding only (a draft model runs its forward)
        except BaseException as exc:
            self._fail_step(exc, t0, None, rollback, outputs)
        plan = self.scheduler.schedule(drafts.tokens)                           # bookkeeping only
        for seq in plan.failed:
            outputs[seq.request_id] = self.table.finish(seq, seq.status)
        for seq in plan.preempted:
            if self.proposer:
                self.proposer.release(seq.seq_id)   # its draft KV goes with its target KV
        rollback.save_rngs(c.seq for c in plan.chunks)
        try:
            chosen = self._compute(plan, drafts, rollback)
        except BaseException as exc:
            self._fail_step(exc, t0, plan, rollback, outputs)
        self.scheduler.mark_computed(plan)                 # the KV of every real token is written
        if any(c.prompt_logprobs for c in plan.chunks):    # prompt log-probabilities join their sequences
            prompt_logprobs.commit(plan.chunks)
        counts = commit(self.table, chosen, drafts, outputs)   # append, fork, trim, prune, finish
        self.scheduler.cache_blocks()      # blocks that filled this step join the prefix cache
        result = self._end_step(t0, plan, outputs, counts)
        self._raise_subscriber_errors(result)
        return result

    def _propose(self) -> Drafts:
        """Speculative decoding's guesses for the decoding sequences (none when it is off)."""
        if not self.proposer:
            return Drafts()
        c = self.config
        drafts = spec_decode.propose(self.proposer, self.scheduler.running, c.num_speculative_tokens,
                                     c.max_model_len, c.num_blocks * self.pool.block_size)
        for rid, tokens in drafts.tokens.items():
            self.emit(ev.DraftProposed(self.step_count, rid, self.proposer.method, tuple(tokens)))
        return drafts

    def _fail_step(self, exc: BaseException, t0: float, plan: StepPlan | None, rollback: step_rollback.Rollback,
                   outputs: dict) -> NoReturn:
        """The compute phase raised: undo the plan, close the step, raise StepFailed (or Ctrl-C as is)."""
        lost = rollback.undo(plan)
        result = self._end_step(t0, plan, outputs, (0, 0), computed=False)
        err = step_rollback.failure(self.step_count, exc, plan, lost, result, rollback.blocks_moved)
        if err is exc:
            raise exc                     # Ctrl-C and the like, with the step's result attached
        raise err from exc

    def _compute(self, plan: StepPlan, drafts: Drafts, rollback: step_rollback.Rollback) -> list[Choice]:
        """Block moves, the forward, the token choice: tensors and RNGs only, no bookkeeping."""
        # Swap out first (those device blocks may be handed to someone else in this very step),
        # then swap in, then copy-on-write copies.
        self.runner.swap_out(plan.moves.swap_out)
        self.runner.swap_in(plan.moves.swap_in)
        self.runner.copy_blocks(plan.moves.copies)
        rollback.blocks_moved = True
        if not plan.chunks:
            return []
        inputs = [RunInput(c.token_ids(), c.start, c.seq.block_table,
                           num_logits=1 + len(c.draft_token_ids) if c.samples else 0,
                           group_tables=c.seq.group_tables) for c in plan.chunks]
        if not any(c.seq.needs_prompt_logprobs for c in plan.chunks):
            logits = self.runner.run(self.runner.prepare(inputs))   # [rows, vocab], in chunk order
        else:   # a request asked for its prompt's log-probabilities: more rows come back (prompt_logprobs.py)
            wide = prompt_logprobs.widen(plan.chunks, inputs)
            logits = prompt_logprobs.take(plan.chunks, inputs, wide, self.runner.run(self.runner.prepare(wide)))
        return choose_tokens(self.table, self.sampler, self.components.verify, plan.chunks, inputs, logits, drafts)

    def _end_step(self, t0: float, plan: StepPlan | None, outputs: dict[str, RequestOutput], counts: tuple[int, int],
                  computed: bool = True) -> StepResult:
        """Stats, the StepFinished event, and the StepResult (a failed step computed no tokens)."""
        chunks = plan.chunks if plan is not None and computed else []
        prefill = sum(c.num_tokens for c in chunks if c.is_prefill)
        num_tokens = sum(c.num_tokens for c in chunks)
        stats = StepStats(
            step=self.step_count, num_seqs=len(chunks), num_prefill_tokens=prefill,
            num_decode_tokens=num_tokens - prefill, num_preempted=len(plan.preempted) if plan else 0,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_free_blocks=self.pool.num_free_blocks, num_blocks=self.pool.num_blocks,
            duration_s=time.perf_counter() - t0, num_drafted=counts[0], num_accepted=counts[1],
            num_swapped=len(self.scheduler.swapped),
            graph_bucket=getattr(self.runner, "replayed_bucket", 0) if chunks else 0,
        )
        self.emit(ev.StepFinished(self.step_count, stats.num_seqs, prefill, stats.num_decode_tokens,
                                  stats.num_free_blocks, stats.duration_s))
        events, self._events = self._events, []
        return StepResult(list(outputs.values()), events, stats)

    # -- watching ------------------------------------------------------------------------

    def emit(self, event: ev.Event) -> None:
        """Publish an event: into this step's result and to every subscriber (the engine's parts call it)."""
        self._events.append(event)
        if self.bus.active:
            self.bus.publish(event)

    def subscribe(self, callback: Callable[[ev.Event], None]) -> Callable[[], None]:
        """Call `callback` with every event from now on, first an EngineSynced; returns unsubscribe.

        If `callback` raises, the engine keeps going and so does delivery (to it and to
        everyone else); the operation that emitted the event raises SubscriberError once done.
        """
        callback(synced_event(self.snapshot()))   # (raises here, before anything is subscribed)
        return self.bus.subscribe(callback)

    def _raise_subscriber_errors(self, result=None) -> None:
        """After an operation: raise what subscribers raised during it (the operation itself is done)."""
        self.bus.raise_held(lambda text: SubscriberError(
            f"{text} (the engine completed the operation and delivered every event)", result))

    def snapshot(self) -> dict:
        """The engine's state as plain data: pool, block tables, queues, radix tree, CPU pool."""
        ranks = self.runner.rank_info() if hasattr(self.runner, "rank_info") else None   # tensor parallelism
        return engine_state.snapshot(self.table, self.scheduler, self.kv, self.pool, self.radix, self.cpu_pool,
                                     self.config, self.implementation, ranks)

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        engine_state.check_invariants(self.table, self.scheduler, self.pool, self.radix, self.cpu_pool, self.runner)

    # -- statistics over the engine's life ------------------------------------------------

    def spec_stats(self) -> dict:
        """Speculative decoding over the engine's life: acceptance rate and tokens per target forward."""
        return engine_state.spec_stats(self.table.spec_totals)


    # -- prefix cache --------------------------------------------------------------------

    def _span_text(self, tokens: list[int]) -> str:
        """A radix node's tokens as text, for events and views."""
        if self.tokenizer is None:
            return " ".join(map(str, tokens))
        return self.tokenizer.decode(tokens)

    def prefix_cache_stats(self) -> dict:
        """Over the engine's life: tokens looked up at admission, tokens a hit skipped, and their ratio."""
        return engine_state.prefix_cache_stats(self.kv, self.radix)

    def clear_prefix_cache(self) -> int:
        """Evict every cached block nobody is using; returns how many went back to the free queue."""
        freed = self.kv.clear_cache()   # (KV cache groups: the companions too, group_cache.py)
        self._raise_subscriber_errors(freed)
        return freed
