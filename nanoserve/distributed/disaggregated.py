"""Prefill/decode disaggregation: a prefill engine and a decode engine in two processes, KV handed over.

Prefill and decode want different things. A prefill chunk is hundreds of
tokens in one matmul: compute-bound, it keeps the arithmetic units busy. A
decode step is one token per request that reads the whole KV cache:
memory-bound, it wants a big batch and a big pool. In one engine they share
every step, so a long prompt makes every decoding request wait (the
inter-token latency spikes). Disaggregated serving (DistServe, Zhong et al.
2024; Splitwise; Mooncake; vLLM's disaggregated prefill) runs them on
different workers and ships the KV cache from one to the other.

Here the driver process holds the *decode* engine; a worker process (rank 1
of a gloo group) holds the *prefill* engine, which keeps the prefix cache
(the decode engine runs without one). Each `step()` of a
`DisaggregatedEngine` is one tick of both:

    driver (decode engine)                     worker (prefill engine)
    send new requests  ───────────────────────▶  add them; step once: prompts, chunked,
    decode.step()   (both compute at once)       with prefix-cache hits
    receive handoffs ◀───────────────────────  for each prompt that is done: copy its
                                                blocks out, let go of the request
    adopt: fresh blocks in the decode pool,
    KV written in, the request RUNNING

The prefill engine samples with max_tokens=2 and ignore_eos, so a request is
never finished there; once its prompt is computed, its blocks (the KV of
all prompt tokens but the last) are shipped, and the request is aborted
there (its full blocks stay in the prefix cache). The decode engine
computes the last prompt token itself, which gives the logits of the first
output token, sampled with the request's own seed: so outputs equal a single
engine's, for greedy and seeded sampling alike (vLLM does the same: the
prefill instance's token is not used, the decode side recomputes the last
prompt token).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from nanoserve import intake
from nanoserve.config import EngineConfig
from nanoserve.distributed.group import WorkerGroup
from nanoserve.distributed.kv_transfer import adopt, digest, export_blocks, payload_shape
from nanoserve.engine import LLMEngine
from nanoserve.errors import FieldError
from nanoserve.models.loader import LoadedModel, load_model
from nanoserve.outputs import RequestOutput, StepResult
from nanoserve.sampling_params import SamplingParams

# What the prefill side samples: one token it will not finish on (the decode side samples for real).
PREFILL_PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


@dataclass(slots=True)
class Tick:
    """Driver -> prefill worker, once per step."""

    new: list[tuple[str, list[int]]] = field(default_factory=list)   # (request id, prompt token ids)
    step: bool = True             # step the prefill engine once
    check: bool = False           # run its check_invariants()
    stop: bool = False


@dataclass(slots=True)
class Handoff:
    """One request whose prompt the prefill engine computed; its KV follows in the tick's payload."""

    request_id: str
    src_block_ids: list[int]      # blocks of the prefill pool the KV came from, in table order
    num_tokens: int               # tokens whose KV is in them: the prompt but its last token
    num_bytes: int
    digest: str                   # of the payload bytes, taken on the prefill side
    export_s: float               # time to copy them out of the prefill pool


@dataclass(slots=True)
class Reply:
    handoffs: list[Handoff]
    num_prefill_tokens: int = 0   # tokens the prefill engine computed this tick
    prefix_cache: dict = field(default_factory=dict)   # its prefix_cache_stats()
    problems: str = ""            # what its check_invariants() raised, if asked


@dataclass(slots=True)
class Transfer:
    """What the driver saw of one KV handoff (also a KVTransferred event of the decode engine)."""

    request_id: str
    src_block_ids: list[int]
    block_ids: list[int]          # where the KV landed in the decode pool
    num_tokens: int
    num_bytes: int
    sent_digest: str              # hashed on the prefill side
    landed_digest: str            # hashed from the decode pool's blocks after the import
    seconds: float                # export + wire + import


def prefill_main(comm, model: torch.nn.Module, config: EngineConfig, eos_token_id) -> None:
    """The prefill worker: its own engine (prefix cache on), stepped once per tick."""
    loaded = LoadedModel(model, None, eos_token_id, config.model, None)
    engine = LLMEngine(config, loaded=loaded)
    bs = config.block_size
    while True:
        tick: Tick = comm.recv_object(0)
        if tick.stop:
            return
        for rid, token_ids in tick.new:
            engine.add_request(rid, token_ids, PREFILL_PARAMS)
        reply, payloads = Reply([]), []
        if tick.step and engine.has_unfinished_requests():
            result = engine.step()
            reply.num_prefill_tokens = result.stats.num_prefill_tokens
            for out in result.outputs:
                seq = engine.sequences.get(out.request_id)
                if seq is None:        # finished on its first token (max_model_len): no KV to hand over
                    reply.handoffs.append(Handoff(out.request_id, [], 0, 0, "", 0.0))
                    continue
                num_tokens = seq.num_prompt_tokens - 1
                blocks = seq.block_table[: -(-num_tokens // bs)]
                if not blocks:         # a one-token prompt: nothing to ship, the decode side computes it
                    reply.handoffs.append(Handoff(out.request_id, [], 0, 0, "", 0.0))
                    engine.abort_request(out.request_id)
                    continue
                t0 = time.perf_counter()
                payload = export_blocks(engine.runner.kv_caches, blocks)
                payloads.append(payload)
                reply.handoffs.append(Handoff(out.request_id, blocks, num_tokens,
                                              payload.numel() * payload.element_size(), digest(payload),
                                              time.perf_counter() - t0))
                engine.abort_request(out.request_id)   # handed over; its full blocks stay cached here
        if tick.check:
            try:
                engine.check_invariants()
            except AssertionError as exc:
                reply.problems = str(exc)
        reply.prefix_cache = engine.prefix_cache_stats()
        comm.send_object(reply, 0)
        if payloads:
            comm.send(torch.cat(payloads), 0)


@dataclass(slots=True)
class _Staged:
    """A handoff that arrived and waits for room in the decode pool."""

    prompt: object
    params: SamplingParams
    handoff: Handoff
    payload: torch.Tensor
    wire_s: float


class DisaggregatedEngine:
    """A prefill engine (worker process, prefix cache) and a decode engine (this process), KV handed over."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, **kwargs) -> None:
        config = config or EngineConfig(**kwargs)
        if config.tensor_parallel_size != 1 or config.speculative_method is not None:
            raise ValueError("disaggregation runs each side in one process without speculative decoding")
        dtype = getattr(torch, config.dtype)
        loaded = loaded or load_model(config.model, dtype, config.device, config.seed)
        # The handoff moves one block table per request: every layer's KV in one group (kv_groups.py, no
        # window freeing on either side).
        config = dataclasses.replace(config, kv_window_freeing=False)
        # The decode side keeps no prefix cache: requests arrive with their KV.
        self.decode = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False), loaded=loaded)
        prefill_config = dataclasses.replace(config, enable_prefix_caching=True)
        self.group = WorkerGroup.start(2, prefill_main, (loaded.model, prefill_config, loaded.eos_token_id),
                                       what="prefill engine")
        self.comm = self.group.comm
        self.waiting: dict[str, tuple] = {}       # sent to the prefill side: (prompt, params)
        self.new: list[tuple[str, list[int]]] = []   # not sent yet
        self.staged: deque[_Staged] = deque()     # KV arrived, waiting for room in the decode pool
        self.transfers: list[Transfer] = []       # every handoff so far
        self.prefill_tokens = 0                   # tokens the prefill engine computed
        self.num_stalls = 0                       # ticks that ended with KV waiting for room in the decode pool
        self.prefix_cache: dict = {}              # the prefill engine's prefix_cache_stats()

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request for the prefill engine; it decodes here once its KV arrives.
        Raises FieldError (naming the argument or field) and changes nothing on bad input."""
        if request_id in self.waiting or any(s.handoff.request_id == request_id for s in self.staged):
            raise FieldError("request_id", f"{request_id!r} is already in use")
        # The decode engine's own checks (id, prompt, params, limits), without adding anything to it.
        prepared = intake.prepare(self.decode, request_id, prompt, params)
        params = prepared.request.params
        if params.use_beam_search:
            raise FieldError("beam_width", "beam search does not run disaggregated (its beams fork every step)")
        if params.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "are not computed disaggregated (the prompt's logits stay on the "
                                                "prefill engine)")
        self.waiting[request_id] = (prompt, params)
        self.new.append((request_id, list(prepared.seq.prompt_token_ids)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.staged) or self.decode.has_unfinished_requests()

    # -- one tick of both engines ---------------------------------------------------------------

    def step(self) -> StepResult:
        """Send new prompts, step the decode engine while the prefill engine steps, take the handoffs."""
        with self.group.guard():
            self.comm.send_object(Tick(self.new), 1)
            self.new = []
        result = self.decode.step() if self.decode.has_unfinished_requests() else StepResult([])
        with self.group.guard():
            reply: Reply = self.comm.recv_object(1)
            t0 = time.perf_counter()
            total = sum(h.num_bytes for h in reply.handoffs)
            payload = self._recv_payload(reply.handoffs) if total else None
            wire = time.perf_counter() - t0
        self.prefill_tokens += reply.num_prefill_tokens
        self.prefix_cache = reply.prefix_cache
        offset = 0
        for h in reply.handoffs:
            n = len(h.src_block_ids)
            part = payload[offset : offset + n] if n else None
            offset += n
            prompt, params = self.waiting.pop(h.request_id)
            self.staged.append(_Staged(prompt, params, h, part, wire * (h.num_bytes / total) if total else 0.0))
        self._adopt_staged()
        return result

    def _recv_payload(self, handoffs: list[Handoff]) -> torch.Tensor:
        caches = self.decode.runner.kv_caches
        shape = payload_shape(caches, sum(len(h.src_block_ids) for h in handoffs))
        return self.comm.recv(torch.empty(shape, dtype=caches[0][0].dtype), 1)

    def _adopt_staged(self) -> None:
        """Move arrived requests into the decode pool, oldest first, while blocks and seats last."""
        decode, pool = self.decode, self.decode.pool
        while self.staged:
            s = self.staged[0]
            need = pool.blocks_needed(0, s.handoff.num_tokens)
            if need > decode.kv.num_available_blocks or \
                    decode.scheduler.seats_used + s.params.num_seqs > decode.config.max_num_seqs:
                self.num_stalls += 1  # it waits here, its KV in a CPU buffer, until a decode step frees room
                break
            self.staged.popleft()
            h = s.handoff
            blocks = adopt(decode, h.request_id, s.prompt, s.params, s.payload, h.num_tokens, h.src_block_ids,
                           seconds=h.export_s + s.wire_s)
            landed = digest(export_blocks(decode.runner.kv_caches, blocks)) if blocks else ""
            self.transfers.append(Transfer(h.request_id, h.src_block_ids, blocks, h.num_tokens, h.num_bytes,
                                           h.digest, landed, h.export_s + s.wire_s))

    # -- watching and checking --------------------------------------------------------------------

    def subscribe(self, callback):
        """The decode engine's events (KVTransferred among them)."""
        return self.decode.subscribe(callback)

    def check_invariants(self) -> None:
        """Both engines' bookkeeping, and every handoff arrived byte for byte."""
        self.decode.check_invariants()
        with self.group.guard():
            self.comm.send_object(Tick(step=False, check=True), 1)
            reply: Reply = self.comm.recv_object(1)
        assert not reply.problems, f"prefill engine: {reply.problems}"
        for t in self.transfers:
            assert t.sent_digest == t.landed_digest, f"{t.request_id}: the KV that landed is not the KV that left"

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run `prompts` to the end; outputs in prompt order."""
        ids = [f"d{len(self.transfers) + len(self.waiting) + i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step().outputs:
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def shutdown(self) -> None:
        if self.group.alive:
            try:
                self.comm.send_object(Tick(stop=True), 1)
            except RuntimeError:
                pass
        self.group.shutdown()

    def __enter__(self) -> DisaggregatedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
