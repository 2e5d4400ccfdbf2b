"""The errors nanoserve raises on purpose, so callers can tell bad input from bugs.

`FieldError` is a bad value for one named setting: an `EngineConfig` or
`SamplingParams` field, or a request's prompt. It is a `ValueError`, so
existing `except ValueError` code keeps working, and it carries the field's
name so the command line can say which *flag* was wrong:

    >>> e = FieldError("block_size", "must be at least 1, got 0")
    >>> str(e), e.field, e.text
    ('block_size must be at least 1, got 0', 'block_size', 'must be at least 1, got 0')

`cli.py` maps `field` to its flag (`--block-size must be at least 1, got 0`).
"""

from __future__ import annotations


class FieldError(ValueError):
    """A bad value for the setting `field`; the message reads "<field> <text>"."""

    def __init__(self, field: str, text: str) -> None:
        super().__init__(f"{field} {text}")
        self.field = field   # the dataclass field (or "prompt"), e.g. "block_size"
        self.text = text     # what is wrong with it, e.g. "must be at least 1, got 0"


class StepFailed(RuntimeError):
    """`engine.step()` could not compute its step (the forward pass or the token choice raised).

    The engine undid the step's plan before raising: the requests named in
    `request_ids` keep every token they had and run again from the next step,
    `check_invariants()` holds, and `result` is the step's StepResult (its
    events, and the outputs of requests the scheduler finished before the
    failure). The original exception is the `__cause__`.
    """

    def __init__(self, text: str, request_ids: tuple[str, ...] = (), result=None) -> None:
        super().__init__(text)
        self.request_ids = request_ids
        self.result = result


class SubscriberError(RuntimeError):
    """An event subscriber raised. The engine never lets a viewer stop it half way: it finished
    the operation (and delivered every event to every subscriber) first. `result` is what the
    operation returned (a StepResult for `step()`); the subscriber's exception is the `__cause__`."""

    def __init__(self, text: str, result=None) -> None:
        super().__init__(text)
        self.result = result


class EngineBroken(RuntimeError):
    """The engine cannot run another step (a distributed engine's worker process died): no rollback
    helps, so `step()` raises it as it is instead of a StepFailed. Start a new engine."""
