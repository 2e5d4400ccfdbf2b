"""The step-commit lab's bench: what its checks build a student's RequestTable with, and run it against.

* stand-ins for the parts a table talks to that the checks want to see (a letter tokenizer, a grammar matcher,
  a proposer that records what it is told) and `Setup`, a table built with the engine's own scheduler, KV
  manager and pool around the student's class;
* `same_events`: the real engine with the student's table and with its own, every step's events compared.

The rows themselves are in commit_lab.py.
"""

from __future__ import annotations

import torch

from nanoserve.block_pool import BlockPool
from nanoserve.components import Components
from nanoserve.events import StepClock
from nanoserve.labs.drive import TINY
from nanoserve.labs.lab import CheckFailed, Context

EOS = 2                  # the end-of-sequence id of the checks' tables


class Letters:
    """The checks' tokenizer: token id i is the letter chr(ord('a') + i % 26), so text is easy to read."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


class Grammar:
    """A stand-in for a structured output's matcher: it ends after `ends_after` tokens; records what it accepted."""

    vocab_size = 100

    def __init__(self, ends_after: int) -> None:
        self.ends_after = ends_after
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(int(token_id))
        return len(self.accepted) >= self.ends_after

    def fork(self):
        return Grammar(self.ends_after)


class Proposer:
    """A stand-in for speculative decoding's proposer: records which sequences it was told to forget."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, seq_id: str) -> None:
        self.released.append(seq_id)

    def accepted(self, seq, num_tokens_before: int, accepted: int) -> None:
        pass


class Setup:
    """The engine's config, pool, KV manager and scheduler (here); the student's RequestTable (in the worker)."""

    def __init__(self, ctx: Context, max_model_len: int = 64, proposer: Proposer | None = None,
                 max_num_seqs: int = 8) -> None:
        from nanoserve.config import EngineConfig
        from nanoserve.kv_manager import KVManager
        from nanoserve.scheduler import Scheduler
        self.config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=24, max_model_len=max_model_len,
                                   max_num_batched_tokens=32, max_num_seqs=max_num_seqs)
        self.pool = BlockPool(24, 4)
        self.events: list = []
        self.clock = StepClock()
        self.clock.step = 5
        self.kv = KVManager(self.pool, None, None, self.events.append, clock=self.clock)
        self.sched = Scheduler(self.config, self.kv, self.events.append, clock=self.clock)
        self.proposer = proposer
        self.table = ctx.module.RequestTable(self.config, self.sched, self.kv, proposer, Letters(), EOS,
                                             self.events.append, self.clock)

    def request(self, rid: str, prompt_len: int = 5, grammar: Grammar | None = None, seqs: list | None = None,
                **params):
        """Add request `rid` and run its prompt (its blocks held, its KV computed): returns its sequence."""
        from nanoserve.detokenizer import IncrementalDetokenizer
        from nanoserve.intake import PreparedRequest
        from nanoserve.request import Request
        from nanoserve.sampling_params import SamplingParams
        from nanoserve.sequence import Sequence
        sp = SamplingParams(**{"max_tokens": 8, **params})
        seq = Sequence(rid, None, list(range(30, 30 + prompt_len)), sp, request_id=rid, grammar=grammar,
                       logprobs=[] if sp.logprobs is not None else None)
        request = Request(rid, sp, 7, [seq])
        self.table.add(PreparedRequest(seq, request, IncrementalDetokenizer(Letters(), sp)))
        plan = self.sched.schedule()
        self.sched.mark_computed(plan)
        self.events.clear()
        return seq

    def child(self, parent, child_id: str):
        """A fork of `parent` made by hand (the engine's own steps, not the student's fork): for the checks
        that come before fork's."""
        from nanoserve.detokenizer import IncrementalDetokenizer
        child = parent.fork(child_id, torch.Generator())
        self.kv.fork(parent, child, 0)
        self.sched.running.append(child)
        self.table.requests[parent.request_id].seqs.append(child)
        self.table.sequences[child_id] = child
        self.table.detokenizers[child_id] = IncrementalDetokenizer(Letters(), parent.params)
        return child

    def live_blocks(self) -> list[int]:
        return [b.block_id for b in self.pool.blocks if b.ref_count > 0]


def token(token_id: int, logprob: float = -0.5, top=None, mask=None):
    from nanoserve.sampler import SampledToken
    return SampledToken(token_id, logprob, top, mask)


def _status(got) -> str:
    """A returned status as the text a message shows (None, or its finish reason)."""
    return "None" if got is None else str(getattr(got, "finish_reason", got))


# -- the real engine -------------------------------------------------------------------------------------------

def _untimed(event):
    """The event without its wall-clock fields (two runs never take the same time)."""
    import dataclasses
    timed = [f.name for f in dataclasses.fields(event) if f.name.endswith("_s")]
    return dataclasses.replace(event, **{name: 0.0 for name in timed}) if timed else event


def _events(ctx: Context, components: Components, requests: list[tuple], config: dict, fork_at: dict):
    """Run the engine to the end; every step's events and the completions."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import LLMEngine
    from nanoserve.labs.drive import reference_invariants

    cfg = {**TINY, **config}
    engine = LLMEngine(EngineConfig(**cfg), loaded=ctx.loaded(cfg["model"]), components=components)
    trace = []
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outputs = {}
    for step in range(1, 300):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        reference_invariants(engine)
        trace.append([_untimed(e) for e in result.events])
        for out in result.outputs:
            if out.finished:
                outputs[out.request_id] = [(list(c.token_ids), c.text, c.finish_reason) for c in out.outputs]
        for rid, at in fork_at.items():
            if at == step and rid in engine.sequences:
                engine.fork(rid)
    else:
        raise CheckFailed("requests still unfinished after 300 steps", "a sequence that never finishes: the stop "
                          "conditions or finish")
    return trace, outputs


def same_events(ctx: Context, requests: list[tuple], config: dict | None = None, fork_at: dict | None = None,
                hint: str = "") -> None:
    """The engine with the student's table and with its own: the same events at every step, the same outputs."""
    want_trace, want = _events(ctx, Components(), requests, config or {}, fork_at or {})
    got_trace, got = _events(ctx, ctx.components(), requests, config or {}, fork_at or {})
    for k, (w, g) in enumerate(zip(want_trace, got_trace)):
        if w != g:
            extra = [e for e in g if e not in w]
            missing = [e for e in w if e not in g]
            said = f"extra {extra[:2]}" if extra else f"missing {missing[:2]}" if missing else "their order differs"
            raise CheckFailed(f"step {k + 1}: your table's events differ from the engine's own ({said})", hint)
    if len(want_trace) != len(got_trace):
        raise CheckFailed(f"your engine ran {len(got_trace)} steps, the engine's own {len(want_trace)}", hint)
    for rid in want:
        if got.get(rid) != want[rid]:
            raise CheckFailed(f"request {rid}: completions {got.get(rid)}, the engine's own table gives {want[rid]}",
                              hint)
