"""The capstone: every lab's part at once, as one engine (what `--lab DIR` and `nanoserve lab capstone` build).

A capstone folder holds the student's files from the labs, by the starter's
file name (`block_pool.py`, `scheduler.py`, ...), in the folder itself or in
a folder named after the lab (what `nanoserve lab start NAME` writes). Each
part found replaces the engine's own in one `Components` record; a part not
found runs the engine's own and is reported as such (never as the
student's).

Two labs fill blanks of the same class: scheduler-budget and preemption both
write methods of `Scheduler`. The capstone's scheduler is the
scheduler-budget file's class with the preemption file's blanks taken from
the preemption file (each blank from the lab that owns it). The Triton lab's
kernel runs under the interpreter, far too slow at a real model's scale: it
keeps its own check and is not part of the engine here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from nanoserve.errors import FieldError

# The labs whose part goes into the capstone's engine, in the order the engine's step uses them.
PARTS = ("block-pool", "radix-cache", "cow-fork", "scheduler-budget", "preemption", "paged-attention",
         "rejection-sampling", "step-commit")
LEFT_OUT = {"triton-decode": "keeps its own check (the interpreter is far too slow at a real model's scale)"}


@dataclass(frozen=True, slots=True)
class Part:
    lab: str                  # the lab's name
    path: Path | None         # the student's file; None: not written yet (the engine's own runs)


def find_parts(folder: str | Path) -> list[Part]:
    """Each capstone lab's file in `folder` (or `folder/<lab>/`), None where there is none. FieldError for a
    folder that does not exist."""
    from nanoserve.labs import get_lab
    root = Path(folder)
    if not root.is_dir():
        raise FieldError("lab", f"{folder}: no such folder (a capstone folder holds your files from the labs)")
    parts = []
    for name in PARTS:
        file_name = get_lab(name).file_name
        found = [p for p in (root / name / file_name, root / file_name) if p.is_file()]
        parts.append(Part(name, found[0] if found else None))
    return parts


def merged_scheduler(budget, preemption):
    """A Scheduler class with scheduler-budget's blanks from `budget` and preemption's from `preemption`
    (either may be None: that lab's blanks are the engine's own; each starter keeps the other lab's methods
    as the engine wrote them)."""
    from nanoserve import scheduler as engine
    from nanoserve.labs import get_lab
    base = budget.Scheduler if budget is not None else engine.Scheduler
    if preemption is None:      # (the scheduler-budget starter keeps the engine's own preemption methods)
        return base
    owner = preemption.Scheduler
    taken = {q.split(".", 1)[1]: owner.__dict__[q.split(".", 1)[1]] for q in get_lab("preemption").blanks}
    return type("Scheduler", (base,), {**taken, "__doc__": base.__doc__, "__module__": base.__module__})


def components(modules: dict):
    """The engine's Components with each lab's part from `modules` (lab name -> the student's module)."""
    from nanoserve.components import Components
    from nanoserve.labs import get_lab
    replaced = {}
    for name, module in modules.items():
        if name in ("scheduler-budget", "preemption") or module is None:
            continue
        replaced.update(get_lab(name).components(module).replaced())
    if modules.get("scheduler-budget") is not None or modules.get("preemption") is not None:
        replaced["scheduler"] = merged_scheduler(modules.get("scheduler-budget"), modules.get("preemption"))
    return dataclasses.replace(Components(), **replaced)


def load_parts(parts: list[Part]) -> dict:
    """lab name -> the student's module (None where not written), each file checked for the engine's
    signatures. FieldError naming the file at the first problem."""
    from nanoserve.labs import get_lab
    from nanoserve.labs.load import LoadError, load_student
    from nanoserve.labs.starter import signature_mismatches
    modules = {}
    for part in parts:
        if part.path is None:
            modules[part.lab] = None
            continue
        try:
            module = load_student(part.path)
        except LoadError as exc:
            raise FieldError("lab", str(exc)) from None
        bad = signature_mismatches(get_lab(part.lab), module)
        if bad:
            raise FieldError("lab", f"{part.path}: {'; '.join(bad)}")
        modules[part.lab] = module
    return modules


def folder_components(folder: str | Path, without: tuple[str, ...] = ()):
    """`--lab DIR`: the Components of every part in the capstone folder `folder` (the labs in `without` run
    the engine's own part: the judge finds the part at fault that way)."""
    parts = [Part(p.lab, None) if p.lab in without else p for p in find_parts(folder)]
    return components(load_parts(parts))


# -- recording a scenario (the capstone's judge calls this in the lab's worker, next to the student's code) --

# The scenarios every capstone runs: every mechanism the parts take part in (tensor parallelism and structured
# output involve no lab's part beyond these).
SCENARIOS = ("continuous-batching", "memory-pressure", "long-prompt", "shared-system-prompt", "parallel-sampling",
             "swap-preemption", "speculative-decoding")


def untimed(d: dict) -> dict:
    """An event (as a dict) without its wall-clock fields (two runs never take the same time) and without the
    line that names the code that ran (a student's module has another name than the engine's)."""
    return {k: (0.0 if k.endswith("_s") else v) for k, v in d.items() if k != "implementation"}


def reference_components(yours: list[str]):
    """The reference engine to compare with: the engine's own parts, on the same attention path as the
    student's (the paged-attention lab's torch backend, with the engine's own ops), so that every float
    is computed the same way."""
    from nanoserve.components import Components
    if "paged-attention" not in yours:
        return Components()
    import importlib

    from nanoserve.labs import get_lab
    lab = get_lab("paged-attention")
    return lab.components(importlib.import_module(lab.module))


def run_scenario(name: str, components=None, model: str = "tiny-llama", loaded=None, max_steps: int = 400) -> dict:
    """Scenario `name` run to the end with `components`: {"events": [event dicts, EngineSynced first],
    "outputs": {request id: [[token ids], text, finish reason] per completion}, "steps", "tokens", "seconds"}."""
    import time

    from nanoserve.scenarios import ScenarioRunner, get_scenario
    from nanoserve.trace import event_to_dict

    runner = ScenarioRunner(get_scenario(name), model, loaded=loaded, components=components)
    events: list[dict] = []
    outputs: dict = {}
    steps = tokens = 0
    with runner.engine:
        ran = []                   # the Implementation line of the engine that ran (reported, not compared)
        runner.engine.subscribe(lambda e: (ran or ran.append(event_to_dict(e).get("implementation")),
                                           events.append(untimed(event_to_dict(e)))))
        start = time.perf_counter()
        while not runner.done and steps < max_steps:
            result = runner.step()
            steps += 1
            for out in result.outputs:
                tokens += sum(1 for _ in out.outputs)
                if out.finished:
                    outputs[out.request_id] = [[list(c.token_ids), c.text, c.finish_reason] for c in out.outputs]
        seconds = time.perf_counter() - start
    return {"events": events, "outputs": outputs, "steps": steps, "tokens": tokens, "seconds": seconds,
            "implementation": ran[0] if ran else None}


_built: dict = {}     # (folder, model) -> (Components, LoadedModel): built once per worker


def prepare(folder: str, model: str = "tiny-llama", without: list[str] | tuple = ()) -> None:
    """Load the student's parts and the model once per worker (the judge calls this before timing a scenario)."""
    from nanoserve.models.loader import load_model
    key = (folder, model, tuple(without))
    if key not in _built:
        loaded = next((b[1] for k, b in _built.items() if k[1] == model), None) or load_model(model)
        _built[key] = (folder_components(folder, tuple(without)), loaded)


def record_json_one(folder: str, name: str, model: str = "tiny-llama", without: list[str] | tuple = ()) -> str:
    """Scenario `name` run with the student's parts from `folder` (but those in `without`), as JSON text
    (plain data: the judge reads it in its own process and decides there)."""
    import json
    prepare(folder, model, without)
    comps, loaded = _built[folder, model, tuple(without)]
    return json.dumps(run_scenario(name, comps, model, loaded))


def parity_prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (short ones, and ones that span several blocks and chunks)."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for length in (1, 3, 8, 17, 31, 47, 60, 71)[:n]]


def greedy_json(folder: str, model: str, prompts: list[list[int]], max_tokens: int) -> str:
    """The student's engine's greedy tokens for `prompts`, all in one batch (chunked, preempting), as JSON."""
    import json

    from nanoserve.config import EngineConfig
    from nanoserve.engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams
    prepare(folder, model)
    comps, loaded = _built[folder, model, ()]
    engine = LLMEngine(EngineConfig(model=model, block_size=8, num_blocks=48, max_num_batched_tokens=64),
                       loaded=loaded, components=comps)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), list(p), params)
    done: dict[str, list[int]] = {}
    with engine:
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
    return json.dumps([done.get(str(i)) for i in range(len(prompts))])
