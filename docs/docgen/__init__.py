"""docgen: every transcript, picture and fact in the docs, made by running the engine.

`python docs/generate.py` runs every job and rewrites what changed;
`python docs/generate.py --check` only compares (tests/test_docs.py does the
same, job by job). A job runs one workload once and returns everything the
pages draw from it:

* region bodies: page -> region name -> text (see `regions.py`): REPL and CLI
  transcripts, and facts (block numbers, steps, requests) stated in prose;
* files: pictures (Graphviz SVGs, TUI screenshots) and lesson outputs.

A job may also assert what its page's prose takes for granted (for example
"the victim is the newest request"), so a change in the engine that makes a
sentence false stops the generator instead of slipping into the docs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]      # the repository
DOCS = ROOT / "docs"


@dataclass
class Result:
    regions: dict[str, dict[str, str]] = field(default_factory=dict)   # page (under docs/) -> name -> body
    files: dict[str, bytes] = field(default_factory=dict)              # path (under the repository) -> bytes

    def region(self, page: str, name: str, body) -> None:
        self.regions.setdefault(page, {})[name] = str(body)

    def facts(self, page: str, prefix: str, values: dict) -> None:
        """Several inline facts at once: region `prefix.key` gets `values[key]`."""
        for key, value in values.items():
            self.region(page, f"{prefix}.{key}", value)


@dataclass(frozen=True)
class Job:
    name: str
    module: str          # docgen.<module>.make(pages) -> Result
    slow: bool = False   # needs SmolLM2 or takes more than a few seconds: tests run it under the slow marker
    about: str = ""

    def run(self, read: Callable[[str], str]) -> Result:
        return importlib.import_module(f"docgen.{self.module}").make(read)


JOBS = [
    Job("traces", "traces", slow=True, about="traces/*.jsonl: every scenario recorded once on SmolLM2 (the "
        "reading path), which the scenarios, web and screens jobs replay; lesson 4's workload, which memory replays"),
    Job("home", "home", about="index.md and getting-started.md's `implementation`: on tiny-llama"),
    Job("step", "step", about="concepts/step.md: lesson 1's runs, events of two steps, a slot table"),
    Job("scenarios", "scenarios", about="tui.md and classroom.md: facts from the recorded scenarios, "
                                         "memory-pressure pictures"),
    Job("memory", "memory", about="prefix-cache, fork, preemption pictures and their captions"),
    Job("life", "life", about="life-of-a-request.md: one request through the modules"),
    Job("kernels", "kernel_facts", about="concepts/kernels.md: the C files' functions and exp, read from them; "
                                         "`gpu_check.py --dry-run` (the resource tables: "
                                         "benchmarks/kernel_resources.py --write-docs)"),
    Job("serving", "serving", about="serve.md: the architecture picture (docs/img/make_serving_pictures.py)"),
    Job("labs", "labs", about="labs/: `nanoserve lab list`, a starter's check, rejection sampling's laws"),
    Job("whatif", "whatif", about="whatif.md: rewind, branch and compare; `nanoserve compare`; two plots"),
    Job("structured", "structured", about="concepts/structured-output.md: the grammar plot of the "
        "structured-output scenario, its facts"),
    Job("distributed", "distributed", slow=True, about="tp-split.svg and tui-disaggregated.svg: a tensor-parallel "
                                             "engine's shards, a disaggregated run's decode side"),
    Job("cli", "cli", slow=True, about="getting-started.md: the CLI on SmolLM2"),
    Job("repl", "repl", slow=True, about="getting-started.md: REPL sessions on SmolLM2 (the reading path)"),
    Job("web", "web", slow=True, about="replay/memory-pressure.html (the home page's replay), web-*.png: the "
        "replay page and `nanoserve web` in Chromium"),
    Job("screens", "screens", slow=True, about="tui-*.svg: the TUI's own screenshots of each scenario"),
]


def read_page(page: str) -> str:
    return (DOCS / page).read_text()
