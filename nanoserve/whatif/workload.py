"""A scenario as a script of commands, run twice: as written, and with some settings changed.

    a, b = scenario_pair("memory-pressure", {"preemption_mode": "swap"})
    compare(a, b)

`scenarios.py` says which requests arrive at which step; here they become
`Command`s (`log.py`), the script a `Run` (`run.py`) follows, so both runs get
exactly the same requests at the same steps. The model is loaded once and
shared by both engines.
"""

from __future__ import annotations

from nanoserve.errors import FieldError
from nanoserve.scenarios import Scenario, get_scenario, has_chat_template, load_for, request_args, scenario_model
from nanoserve.whatif.log import Command
from nanoserve.whatif.run import FIXED, Run
from nanoserve.whatif.settings import checked_config


def scenario_script(scenario: Scenario, chat: bool, tokenizer) -> tuple[dict, list[Command]]:
    """(EngineConfig fields, add commands) of the scenario's plain or chat workload."""
    workload = scenario.workload(chat)
    commands = []
    for arrival in sorted(workload.arrivals, key=lambda a: a.step):
        prompt, params = request_args(arrival, chat, tokenizer)
        commands.append(Command.add(arrival.step, arrival.request_id, prompt, params))
    return dict(workload.config), commands


def scenario_start(scenario: Scenario, model: str = "tiny-llama", loaded=None, changes: dict | None = None,
                   components=None, settings: dict | None = None) -> Run:
    """A run at step 0 of `scenario` (its first arrivals queued), with `changes` to its settings
    (`settings`: the command line's engine flags, over the scenario's own, under `changes`).

    A bad change raises FieldError("set", ...), also when the engine refuses it (a pool that
    does not fit the model's memory budget is only known once the model is)."""
    changes, settings = changes or {}, settings or {}
    model, loaded = scenario_model(scenario, model, loaded)   # (a scenario may need its own model)
    loaded = loaded or load_for(model, settings)
    chat = has_chat_template(loaded.tokenizer) and scenario.chat is not None
    config, script = scenario_script(scenario, chat, loaded.tokenizer)
    config = checked_config({**config, **settings, "model": model}, changes)
    try:
        return Run.start(config, loaded=loaded, script=script, components=components)
    except FieldError as exc:
        if exc.field in changes:
            raise FieldError("set", f"{exc.field}={changes[exc.field]}: {exc}") from None
        raise


def scenario_run(name: str, changes: dict | None = None, model: str = "tiny-llama", loaded=None,
                 max_steps: int = 1000) -> Run:
    """Run scenario `name` to its end with `changes` to its settings (FieldError "set" on a bad one)."""
    return scenario_start(get_scenario(name), model, loaded, changes).run_to(max_steps=max_steps)


def scenario_pair(name: str, changes: dict, model: str = "tiny-llama", loaded=None,
                  settings: dict | None = None) -> tuple[Run, Run]:
    """The scenario as written (A) and with `changes` (B), on one loaded model; `settings` apply to both."""
    get_scenario(name)                                   # a bad name fails before the model loads
    for key in changes:
        if key in FIXED:
            raise FieldError("set", f"{key}={changes[key]}: both runs share one loaded model, so {key} cannot "
                                    "differ (compare two recorded traces instead)")
    settings = settings or {}
    checked_config({**get_scenario(name).config, **settings, "model": model}, changes)   # ... and a bad --set
    loaded = loaded or load_for(model, settings)
    return (scenario_start(get_scenario(name), model, loaded, {}, settings=settings).run_to(max_steps=1000),
            scenario_start(get_scenario(name), model, loaded, changes, settings=settings).run_to(max_steps=1000))
