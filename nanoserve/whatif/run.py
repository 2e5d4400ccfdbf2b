"""A run you can rewind and branch: an engine, the log that rebuilds it, and the commands still to come.

    run = Run.start(EngineConfig(model="tiny-llama", num_blocks=32))
    run.add_request("r1", "Hello", SamplingParams(max_tokens=8))   # or run.engine.add_request(...)
    for _ in range(10):
        run.step()
    back = run.rewind(4)                                  # the same run, as it was after step 4
    other = run.branch(4, preemption_mode="swap")         # ... had it swapped instead of recomputing
    while not other.done:
        other.step()

How rewind works (the choice, and why). The engine is deterministic: the
same settings, the same requests with the same seeds at the same steps give
the same steps, bit for bit. So a rewind *replays the command log* into a
fresh `LLMEngine` built on the same loaded model object (`loaded=`, no
weights are read again) and steps it k times. The alternative, checkpoints,
would copy the KV pool and every piece of bookkeeping at every step; replay
costs k forward passes instead and needs nothing but the determinism that
the tests check anyway (tests/test_whatif_run.py: rewind to every step k,
step on, and the events equal the original's).

Seeds make sampled requests repeat: the log records the seed each request
and each fork actually got (drawn from the engine's RNG when the caller gave
none), and the replay passes it back explicitly.

A branch is a replay with some settings changed: the same requests arrive at
the same steps and the new engine runs from step 0 under the new settings.
Up to the first step where a setting makes a difference (the first
preemption, for `preemption_mode`), the branch's steps are the original's;
from there they differ, and `compare.py` says where. A setting that shapes
memory from the start (block size, pool size) makes them differ from step 1:
there is no "block size 32 until step k". Settings that would need other
weights (model, dtype, device, seed) cannot be branched.

A command the branch cannot repeat (forking a request that is preempted in
the branch, aborting one that already finished there) is skipped and listed
in `run.skipped` with the engine's reason.
"""

from __future__ import annotations

import dataclasses

from nanoserve import events as ev
from nanoserve.config import EngineConfig
from nanoserve.errors import FieldError
from nanoserve.whatif.log import Command, CommandKind, CommandLog

# EngineConfig fields a branch may not change: they decide the weights that `loaded` already holds.
FIXED = ("model", "dtype", "device", "seed", "draft_model", "draft_num_layers")


class Run:
    """An engine, the log of every command given to it, and a script of commands still to come.

    `events` holds every event the engine emitted since the run began (its
    first is the EngineSynced of the empty engine), so a run is also a trace.
    """

    def __init__(self, engine, config: EngineConfig, script=()) -> None:
        """Watch `engine` from its start. `config`: its settings as given, before the engine filled in
        what it derives (pool size, swap space, max_model_len), so a branch derives them afresh."""
        self.engine = engine
        self.config = config
        self.log = CommandLog()
        self.events: list[ev.Event] = []
        self.script: list[Command] = sorted(script, key=lambda c: c.step)   # due when step_count reaches .step
        self.skipped: list[tuple[Command, str]] = []   # (command, why the engine refused it)
        engine.subscribe(self.log)
        engine.subscribe(self.events.append)
        if not self.log.complete:
            raise ValueError(f"a Run needs the engine from its start: {self.log.why_incomplete}")

    @classmethod
    def start(cls, config: EngineConfig | None = None, loaded=None, script=(), components=None, **kwargs) -> Run:
        """A run on a new engine (`loaded`: an already loaded model to reuse), with `script` to come
        (its commands due before the first step are given at once). `components`: the engine's parts
        (components.py), e.g. a student's from `--lab`; a rewind or branch keeps them."""
        from nanoserve.engine import LLMEngine

        config = config if config is not None else EngineConfig(**kwargs)
        given = dataclasses.replace(config)
        run = cls(LLMEngine(config, loaded=loaded, components=components), given, script)
        run.apply_due()
        return run

    # -- driving it ------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @property
    def done(self) -> bool:
        return not self.script and not self.engine.has_unfinished_requests()

    def add_request(self, *args, **kwargs) -> None:
        self.engine.add_request(*args, **kwargs)

    def abort_request(self, request_id: str):
        return self.engine.abort_request(request_id)

    def fork(self, seq_id: str, seed: int | None = None) -> str:
        return self.engine.fork(seq_id, seed)

    def apply_due(self) -> None:
        """Give the engine the script's commands that are due now (made after `step_count` steps)."""
        while self.script and self.script[0].step <= self.engine.step_count:
            command = self.script.pop(0)
            try:
                apply(self.engine, command)
            except (KeyError, ValueError) as exc:   # e.g. a fork of a request this branch preempted
                self.skipped.append((command, str(exc).strip("'\"")))

    def step(self):
        """Run one engine step and give it the commands due after it; returns the StepResult.

        (Commands due before it are given first: a fresh run's, or a rewind's.) Giving the
        commands right after the step, as `ScenarioRunner` does, means that between steps the
        engine is exactly as its command log says, and a viewer sees the new arrivals at once.
        """
        self.apply_due()
        result = self.engine.step()
        self.apply_due()
        return result

    def run_to(self, step: int | None = None, max_steps: int = 10_000):
        """Step until `step_count == step` (None: until the run is done); returns self."""
        while (self.step_count < step) if step is not None else not self.done:
            if self.step_count >= max_steps:
                raise RuntimeError(f"run did not finish within {max_steps} steps")
            self.step()
        return self

    # -- going back ---------------------------------------------------------------------------

    def commands(self) -> list[Command]:
        """Every command of this run, given and still to come, in order."""
        return sorted(self.log.commands + self.script, key=lambda c: c.step)

    def rewind(self, step: int) -> Run:
        """A new run, as this one was right after `step` steps and the commands made then."""
        return self.branch(step)

    def branch(self, step: int, **changes) -> Run:
        """A new run at `step` under the settings changed by `changes` (none: a plain rewind).

        Raises FieldError for a setting that does not exist, has a bad value, or
        needs other weights. The new run has the commands made at `step` and
        later as its script, so stepping it on repeats the rest of the run.
        """
        if not isinstance(step, int) or not 0 <= step <= self.step_count:
            raise FieldError("step", f"must be a step of this run, 0..{self.step_count}, got {step!r}")
        config = branch_config(self.config, changes)
        commands = self.commands()
        past = [c for c in commands if c.step < step]
        future = [c for c in commands if c.step >= step]
        run = Run.start(config, loaded=self.engine.loaded, script=past, components=self.engine.components)
        run.run_to(step)
        run.script = sorted(run.script + future, key=lambda c: c.step)
        run.apply_due()                      # the commands made right after `step`
        return run


def branch_config(config: EngineConfig, changes: dict) -> EngineConfig:
    """`config` with `changes` applied and checked (FieldError on a bad or fixed field)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    for name in changes:
        if name not in names:
            raise FieldError(name, f"is not an engine setting; settings are: {', '.join(sorted(names))}")
        if name in FIXED and changes[name] != getattr(config, name):
            raise FieldError(name, "cannot change in a branch: it needs other weights (start a new run instead)")
    return dataclasses.replace(config, **changes)


def apply(engine, command: Command) -> None:
    """Make the call `command` records on `engine` (may raise what the call raises)."""
    if command.kind is CommandKind.ADD:
        prompt = command.prompt if isinstance(command.prompt, str) else list(command.prompt)
        engine.add_request(command.request_id, prompt, command.sampling_params, priority=command.priority)
    elif command.kind is CommandKind.FORK:
        engine.fork(command.request_id, command.seed)
    else:
        engine.abort_request(command.request_id)
