"""What the engine hands back: RequestOutput, CompletionOutput, StepResult.

Shapes follow vLLM's outputs so that code reading them carries over. Each
step returns a `StepResult` with the outputs of the requests that got a new
token (or finished) in that step, the step's events, and its statistics.
`CompletionOutput.delta` is the text added in this step, for streaming.
How these print in a REPL lives in `viz/repl.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.display import Displayable
from nanoserve.events import Event


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float              # time.monotonic() when the request was added
    first_token_time: float | None   # when its first token was sampled
    finish_time: float | None        # when it finished
    num_sampling_steps: int = 0      # target forwards that gave this request tokens
    num_drafted: int = 0             # speculative decoding: draft tokens checked ...
    num_accepted: int = 0            # ... and accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_drafted if self.num_drafted else None


@dataclass(slots=True)
class CompletionOutput:
    index: int                       # which of the request's completions (0 .. n-1; beams best first)
    text: str                        # the text so far (no stop string, unless include_stop_str_in_output)
    token_ids: list[int]             # the generated tokens so far
    cumulative_logprob: float        # sum of the chosen tokens' log-probabilities
    logprobs: list[dict[int, float]] | None   # per token: {token_id: logprob}, if asked for
    finish_reason: str | None        # "stop", "length", "abort" or None while running
    delta: str = ""                  # text added in this step
    error: str | None = None         # why the engine gave up, when finish_reason is "abort" without a user abort
    seq_id: str = ""                 # the sequence's own id, as every viewer names it: "r1", a fork "r1.1"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, repr=False)     # repr: the rich panel (Displayable)
class RequestOutput(Displayable):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (None for the first, which has
    # no context); None when not asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def tokens_per_forward(self) -> float | None:
        """Tokens generated per target forward that sampled for this request (> 1 with speculation)."""
        steps = self.metrics.num_sampling_steps
        return len(self.outputs[0].token_ids) / steps if steps else None


@dataclass(slots=True)
class StepStats:
    step: int
    num_seqs: int                   # sequences in the forward pass
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    num_waiting: int                # after the step
    num_running: int
    num_free_blocks: int
    num_blocks: int
    duration_s: float
    num_drafted: int = 0            # speculative decoding: draft tokens verified this step
    num_accepted: int = 0           # ... and accepted
    num_swapped: int = 0            # sequences waiting in the CPU pool after the step
    graph_bucket: int = 0           # CUDA graphs: the batch size this step's forward was padded to and
                                    # replayed at (cuda_graphs.py); 0: it ran eagerly


@dataclass(slots=True, repr=False)
class StepResult(Displayable):
    outputs: list[RequestOutput]
    events: list[Event] = field(default_factory=list)
    stats: StepStats | None = None
