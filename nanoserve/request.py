"""Request: one user request and the sequences it runs (one, n for parallel sampling, k beams).

A request starts as one sequence that computes the prompt. With `n > 1` (or
beam search) that sequence is *forked* when its prompt is done: the forks
share every block of the prompt, so the prompt's KV is computed and stored
once. `engine.fork()` adds a sequence to a running request the same way.

This module owns the grouping and what the user gets back (`RequestOutput`
with one `CompletionOutput` per sequence); the engine owns the stepping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve import beam_search
from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence


@dataclass(slots=True)
class Request:
    request_id: str
    params: SamplingParams
    seed: int | None                           # forks derive their RNG seeds from it (set when queued)
    seqs: list[Sequence] = field(default_factory=list)   # every sequence it ran, pruned beams left out
    forked: bool = False                       # n > 1 / beam search: the prompt's sequence has been forked
    next_index: int = 1                        # the index the next fork gets ("<request_id>.<index>")

    @property
    def is_beam_search(self) -> bool:
        return self.params.use_beam_search

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def needs_fork(self) -> bool:
        """Parallel sampling: the prompt's sequence is about to sample its first token."""
        return self.params.n > 1 and not self.params.use_beam_search and not self.forked

    def fork_id(self) -> str:
        fork_id, self.next_index = f"{self.request_id}.{self.next_index}", self.next_index + 1
        return fork_id

    def completions(self) -> list[Sequence]:
        """The sequences to report, in order: by index, or for beam search the n best."""
        if not self.is_beam_search:
            return self.seqs
        lp = self.params.length_penalty
        if self.finished:
            return beam_search.ranked(self.seqs, lp)[: self.params.n]
        return sorted(self.live, key=lambda s: s.cumulative_logprob, reverse=True)   # beams so far

    def output(self, deltas: dict[str, str]) -> RequestOutput:
        """The request as the user sees it; `deltas` maps a sequence id to the text it added this step."""
        first = self.seqs[0]
        outputs = [
            CompletionOutput(
                index=i, text=s.output_text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.status.finish_reason, delta=deltas.get(s.seq_id, ""), error=s.error,
                seq_id=s.seq_id,
            )
            for i, s in enumerate(self.completions())
        ]
        first_times = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        finish_times = [s.finish_time for s in self.seqs if s.finish_time is not None]
        metrics = RequestMetrics(
            first.arrival_time, min(first_times, default=None),
            max(finish_times, default=None) if self.finished else None,
            sum(s.num_sampling_steps for s in self.seqs), sum(s.num_drafted for s in self.seqs),
            sum(s.num_accepted for s in self.seqs),
        )
        prompt_logprobs = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, outputs, self.finished, metrics,
                             prompt_logprobs)
