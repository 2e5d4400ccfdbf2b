"""The TUI's live source: an engine on a worker thread, driven by commands from the UI.

`LiveSource` runs an `LLMEngine` inside a what-if `Run` (nanoserve/whatif/run.py,
which feeds the scenario's arrivals and keeps the command log) on a Textual worker
thread. The UI never touches the engine: it puts commands (step, add, abort, fork,
restart, back, branch) on a queue; the worker executes them one at a time and sends
each command's events back with `call_from_thread`, where they are folded on the UI
thread into `Frame`s (source.py), as a replay's are.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import traceback
from pathlib import Path

from textual.app import App
from textual.worker import get_current_worker

from nanoserve.events import EngineSynced, Event, StepFinished, StepStarted
from nanoserve.models.first_load import listening
from nanoserve.sampling_params import SamplingParams
from nanoserve.scenarios import Scenario, chat_prompt, get_scenario, has_chat_template, scenario_model
from nanoserve.trace import JsonlRecorder, ViewState, fold, synced_event
from nanoserve.whatif.compare import first_divergence
from nanoserve.whatif.run import Run
from nanoserve.whatif.settings import BRANCH_SETTINGS
from nanoserve.whatif.workload import scenario_start
from nanoserve_tui.source import (
    CONTROLS,
    FirstLoadProgress,
    Frame,
    FrameReady,
    LabStepFailed,
    Source,
    SourceStatus,
    Unsupported,
    acceptance_rate,
)

DEFAULT_MODEL = "tiny-llama"

# What `nanoserve tui --model X` runs when no scenario is named: an empty engine
# with a pool small enough to watch. Requests come from the `a` dialog.
PLAYGROUND = Scenario(
    "playground", "An empty engine: add requests with `a`, or pick a preset with `p`.",
    dict(block_size=8, num_blocks=128, max_num_batched_tokens=64, max_num_seqs=8), [],
)



class LiveSource(Source):
    """A live engine stepped on a worker thread; commands go through a queue."""

    mode = "live"
    controls = CONTROLS

    def __init__(self, model: str | None = None, scenario: str | None = None,
                 record: str | Path | None = None, components=None, overrides: dict | None = None,
                 explain=None) -> None:
        self.overrides = dict(overrides or {})       # settings over the scenario's, e.g. {"path": "reading"}
        self.scenario = get_scenario(scenario) if scenario else PLAYGROUND   # ValueError when unknown
        self.model = scenario_model(self.scenario, model or DEFAULT_MODEL)[0]   # (a scenario may name its own)
        self.record = record                          # also write every event to this JSONL trace
        self.components = components                  # `--lab`: the engine's parts replaced (None: its own)
        self.explain = explain                        # `--lab`: exception -> (where and what, hint) for the panel
        self.description = f"{self.scenario.name} on {self.model}{self._yours()}"
        self._commands: queue.Queue[tuple[str, tuple]] = queue.Queue()
        self._pending_steps = 0                       # steps queued and not yet done (UI thread only)
        self._done = False                            # the engine has nothing left to do
        self._failed = False                          # the model did not load
        self._state: ViewState | None = None          # folded on the UI thread
        self._acceptance: tuple[float, ...] = ()
        self._app: App | None = None
        self._settings: dict = {}                     # the run's EngineConfig, set by the worker
        self._base_settings: dict = {}                # ... as the scenario started it (a branch changes _settings)
        self._busy: list[str] = []                    # rewinds and branches queued, not yet delivered (UI thread)
        self._frame: Frame | None = None              # the last frame posted
        self._lab_failed: str | None = None           # `--lab`: the step that failed in the student's code

    def _yours(self) -> str:
        """The title's ending when `--lab` replaced a part, e.g. " with your block_pool" (whose code runs)."""
        names = sorted(self.components.replaced()) if self.components is not None else []
        return f" with your {', '.join(names)}" if names else ""

    # -- UI thread ---------------------------------------------------------------------

    def attach(self, app: App) -> None:
        self._app = app
        app.post_message(SourceStatus("loading", f"loading {self.model} …"))
        app.run_worker(self._serve, thread=True, name="engine", group="engine", exit_on_error=False)

    def step(self, *, if_idle: bool = False) -> None:
        if self._failed:
            raise Unsupported(f"{self.model} did not load; press q to quit")
        if self._state is None:
            raise Unsupported(f"still loading {self.model}")
        if if_idle and self._pending_steps:
            return
        if self._done and not self._pending_steps:
            raise Unsupported("all requests are done: add one with a, or pick a preset with p")
        if self._lab_failed:
            raise Unsupported(f"{self._lab_failed} failed in your code: fix the file, then pick a scenario (p) to "
                              "start again, or step back (b)")
        self._pending_steps += 1
        self._commands.put(("step", ()))

    def add_request(self, request_id: str, prompt: str, params: dict) -> None:
        self._commands.put(("add", (request_id, prompt, params)))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", (request_id,)))

    def fork(self, request_id: str) -> None:
        """Fork a running request (`engine.fork`): the child shares its blocks; the app hears how it went."""
        self._commands.put(("fork", (request_id,)))

    def back(self) -> None:
        """One step back: the command log replayed into a fresh engine (nanoserve/whatif/run.py)."""
        if self._state is None:
            raise Unsupported(f"still loading {self.model}")
        backs = sum(b.startswith("rewinding") for b in self._busy)
        target = self._state.step + self._pending_steps - backs - 1
        if target < 0:
            raise Unsupported("already at step 0")
        self._busy.append(f"rewinding to step {target}: replaying the run …")
        self._commands.put(("back", ()))

    def branch(self, changes: dict) -> None:
        """Go on from this step under other settings (`Run.branch`: the log replayed with them)."""
        if self._state is None:
            raise Unsupported(f"still loading {self.model}")
        what = ", ".join(f"{k}={v}" for k, v in changes.items()) or "the same settings"
        self._busy.append(f"branching with {what}: replaying the run …")
        self._commands.put(("branch", (changes,)))

    @property
    def busy(self) -> str | None:
        """What the engine is replaying for a rewind or a branch, until its frame arrives."""
        return self._busy[0] if self._busy else None

    @property
    def settings(self) -> dict:
        return dict(self._settings)

    @property
    def changes(self) -> dict:
        """The branch settings that differ from the scenario's own (after `w`), e.g. {"preemption_mode": "swap"}."""
        return {k: v for k, v in self._settings.items()
                if k in BRANCH_SETTINGS and k in self._base_settings and self._base_settings[k] != v}

    def restart(self, scenario: str) -> None:
        """Start over on a fresh engine running `scenario` (the model stays loaded).

        The old engine stays on screen, and keeps stepping, until the new one is built."""
        get_scenario(scenario)                        # ValueError for an unknown name, here and now
        self._commands.put(("restart", (scenario,)))

    def close(self) -> None:
        self._commands.put(("stop", ()))

    def _deliver(self, events: list[Event], done: bool, command: str, description: str | None = None,
                 shown_from: int = 0) -> None:
        """Fold a command's events into the view (runs on the UI thread); the frame's event list
        shows `events[shown_from:]` (after a rewind: its last step, not the whole history)."""
        if command == "step":
            self._pending_steps = max(0, self._pending_steps - 1)
        if command in ("back", "branch") and self._busy:
            self._busy.pop(0)                         # (the frame below clears the status line's "rewinding")
        self._done = done
        if description is not None:                   # a restart succeeded: the new scenario's name
            self.description = description
        # Frames already posted must never change under the widgets drawing them (they draw
        # lazily, after later deliveries): fold into a copy, as ReplaySource does.
        state, acceptance = copy.deepcopy(self._state) if events else self._state, self._acceptance
        try:
            for event in events:
                if isinstance(event, EngineSynced):
                    acceptance = ()                   # a fresh engine: fresh metrics
                elif isinstance(event, StepFinished) and shown_from:   # a replayed history: per step
                    rate = acceptance_rate([e for e in events if e.step == event.step])
                    acceptance += () if rate is None else (rate,)
                state = fold(state, event)
        except Exception as exc:   # noqa: BLE001 -- a view that cannot follow: say so, start it afresh
            self._app.notify(f"{type(exc).__name__}: {exc}; the view starts afresh from the engine's state",
                             title="view out of step", severity="error", timeout=30)
            self._commands.put(("sync", ()))
            return
        self._state, self._acceptance = state, acceptance
        rate = None if shown_from else acceptance_rate(events)   # (a history's rates came per step above)
        if rate is not None:
            self._acceptance += (rate,)
        if events and self._state is not None and self._app is not None:
            self._frame = Frame(self._state, tuple(events[shown_from:]), self._acceptance, done)
            self._app.post_message(FrameReady(self._frame))
        elif command in ("back", "branch") and self._frame is not None:   # it failed (a notice says why):
            self._app.post_message(FrameReady(self._frame))              # the same frame, without "rewinding"

    @property
    def lab_failed(self) -> str | None:
        """`--lab`: the step that failed in the student's code ("step 12"), until a restart or a step back."""
        return self._lab_failed

    # -- worker thread -----------------------------------------------------------------

    def _serve(self) -> None:
        """The worker: load the model, then execute commands until told to stop."""
        worker = get_current_worker()
        try:
            with listening(lambda conversion: self._to_ui(self._app.post_message, FirstLoadProgress(conversion))):
                runner = scenario_start(self.scenario, self.model, components=self.components,
                                        settings=self.overrides)
        except Exception as exc:   # noqa: BLE001 -- any loading failure becomes one clear line
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            what = f"could not load model {self.model!r}: {reason}"
            if self.components is not None and self.components.replaced():   # whose code failed: file and line
                frames = traceback.extract_tb(exc.__traceback__)
                at = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}: " if frames else ""
                what = f"could not start the engine{self._yours()}: {at}{type(exc).__name__}: {reason}"
            self._failed = True
            self._to_ui(self._app.post_message, SourceStatus("error", what))
            return
        self._buffer: list[Event] = []               # the current command's events (worker only)
        self._recorder = JsonlRecorder(self.record) if self.record else None
        self._unsubscribe = self._listen(runner)
        self._settings = self._base_settings = dataclasses.asdict(runner.config)
        self.chat_template = self.model if has_chat_template(runner.engine.tokenizer) else None
        hint = "press space to step, r to run" if not runner.done else "press a to add a request, p for a preset"
        self._to_ui(self._app.post_message, SourceStatus("ready", f"{self.description}: {hint}"))
        self._flush(runner, "start")
        try:
            while not worker.is_cancelled:
                try:
                    command, args = self._commands.get(timeout=0.1)
                except queue.Empty:
                    continue
                if command == "stop":
                    break
                self._description, self._shown_from = None, 0
                try:
                    runner = self._execute(runner, command, args)
                except (ValueError, KeyError) as exc:      # bad user input: say so, keep running
                    self._to_ui(self._app.notify, str(exc.args[0] if exc.args else exc), title=command,
                                severity="error")
                except Exception as exc:                    # noqa: BLE001 -- an engine bug: show it, stay up
                    if command == "step" and self.components is not None and self.components.replaced():
                        self._lab_step_failed(runner, exc)  # the student's part: pause there, say it once
                    else:
                        self._to_ui(self._app.notify, f"{type(exc).__name__}: {exc}",
                                    title=f"engine {command} failed", severity="error", timeout=30)
                self._flush(runner, command, description=self._description, shown_from=self._shown_from)
        finally:
            runner.engine.shutdown()                        # (a tensor-parallel engine's worker processes)
            if self._recorder:
                self._recorder.close()

    def _lab_step_failed(self, runner: Run, exc: Exception) -> None:
        """A step failed in the student's component: one panel, with where it failed and the check's hint."""
        if self.explain is not None:
            text, hint = self.explain(exc)
        else:
            text, hint = f"{type(exc).__name__}: {exc}", "nanoserve lab check names the function at fault"
        self._lab_failed = f"step {runner.step_count}"
        self._to_ui(self._app.post_message, LabStepFailed(f"{self._lab_failed}{self._yours()} failed: {text}", hint))

    def _lab_invariants(self, runner: Run) -> None:
        """`--lab`: pause on the step that broke an invariant (a leak, a count), with one panel, as a failure."""
        from nanoserve.labs.plug import broken_invariant

        broken = broken_invariant(runner.engine)
        if broken is not None:
            self._lab_failed = f"step {runner.step_count}"
            self._to_ui(self._app.post_message, LabStepFailed(f"{self._lab_failed}{self._yours()} broke an "
                                                              f"invariant: {broken[0]}", broken[1]))

    def _execute(self, runner: Run, command: str, args: tuple) -> Run:
        """Run one command on the engine; returns the runner to use from now on."""
        if command in ("restart", "back", "branch"):
            self._lab_failed = None                         # a fresh run (or an earlier step) may go on
        elif command == "step" and self._lab_failed:
            return runner                                   # (steps queued before the failure: the run is paused)
        if command == "step" and not runner.done:
            runner.step()
            if self.components is not None and self.components.replaced():
                self._lab_invariants(runner)
        elif command == "add":
            request_id, prompt, params = args
            params = dict(params)
            if params.pop("chat", False):                   # as `nanoserve generate --chat` and the presets
                prompt = chat_prompt(runner.engine.tokenizer, prompt)
            runner.engine.add_request(request_id, prompt, SamplingParams(**params))
        elif command == "abort":
            runner.engine.abort_request(*args)
        elif command == "fork":
            child = runner.engine.fork(*args)      # KeyError / ValueError for an unknown or finished request
            self._to_ui(self._app.notify, f"{args[0]} forked: {child} shares its blocks until one of them "
                                          f"writes into a shared block (copy-on-write)", title="fork")
        elif command == "restart":                          # a fresh engine; the loaded model stays
            scenario = get_scenario(args[0])
            new = scenario_start(scenario, self.model, runner.engine.loaded,   # may fail: the old one stays
                                 components=self.components, settings=self.overrides)
            runner, self.scenario = self._switch(runner, new), scenario
            self._base_settings = self._settings            # a fresh start: nothing is changed yet
            self._description = f"{scenario.name} on {self.model}{self._yours()}"
        elif command == "sync":                             # the view lost track: the whole state again
            self._buffer.append(synced_event(runner.engine.snapshot()))
        elif command == "back":
            if runner.step_count == 0:
                raise ValueError("already at step 0")
            runner = self._switch(runner, runner.rewind(runner.step_count - 1), history=True)
        elif command == "branch":
            (changes,) = args
            new = runner.branch(runner.step_count, **changes)   # FieldError: a notice, the old run stays
            same = first_divergence(runner.events, new.events)
            runner = self._switch(runner, new, history=True)
            what = ", ".join(f"{k}={v}" for k, v in changes.items()) or "unchanged settings"
            so_far = ("the same steps so far" if same is None
                      else f"the same steps until step {same - 1}, different from step {same} on")
            skipped = f"; skipped: {', '.join(c.describe() for c, _ in new.skipped)}" if new.skipped else ""
            self._to_ui(self._app.notify, f"branched at step {new.step_count} with {what}: replayed from step 0 "
                                          f"under the new settings, {so_far}{skipped}", title="branch")
        return runner

    def _switch(self, old: Run, new: Run, history: bool = False) -> Run:
        """Watch `new` instead of `old`. `history`: the view is rebuilt from new's whole event
        history (a rewind or branch replayed it), else from its EngineSynced."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        old.engine.shutdown()                               # (a tensor-parallel engine's worker processes)
        self._buffer.clear()                                # (nothing of the old engine's is pending)
        self._unsubscribe = self._listen(new)               # sends EngineSynced: the view starts afresh
        if history:
            self._buffer[:] = new.events                    # ... from the empty engine, every step again
            starts = [i for i, e in enumerate(new.events) if isinstance(e, StepStarted)]
            self._shown_from = starts[-1] if starts else 0
        self._settings = dataclasses.asdict(new.config)
        return new

    def _listen(self, runner: Run) -> list:
        unsubscribe = [runner.engine.subscribe(self._buffer.append)]
        if self._recorder:
            unsubscribe.append(runner.engine.subscribe(self._recorder))
        return unsubscribe

    def _flush(self, runner: Run, command: str, description: str | None = None, shown_from: int = 0) -> None:
        events = self._buffer[:]
        self._buffer.clear()
        self._to_ui(self._deliver, events, runner.done, command, description, shown_from)

    def _to_ui(self, callback, *args, **kwargs) -> None:
        try:
            self._app.call_from_thread(callback, *args, **kwargs)
        except RuntimeError:   # the app is shutting down
            pass
