"""The import graph points one way: viewers above the engine, the engine above its parts, no cycles.

Read from the source with `ast` (imports inside functions and under `if TYPE_CHECKING:` included: a lazy
import is still a dependency, and a type named in a signature is one a reader must open), so the test
sees what a reader sees.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"nanoserve": ROOT / "nanoserve", "nanoserve_labkit": ROOT / "nanoserve_labkit", "nanoserve_tui": ROOT / "tui"}

# What the viewers (nanoserve/viz, tui/) may read of the engine: its events, the folded view state,
# snapshots and traces, scenarios and the public request API. Not its internals.
VIEWER_MAY_IMPORT = {"nanoserve", "nanoserve.events", "nanoserve.trace", "nanoserve.view", "nanoserve.trace_check",
                     "nanoserve.scenarios", "nanoserve.sampling_params", "nanoserve.errors", "nanoserve.display",
                     "nanoserve.kv_usage",   # the words and arithmetic of "used" and "hit rate", shared with /metrics
                     "nanoserve.models.default",   # which model a command runs when none is named (no torch)
                     "nanoserve.models.first_load",   # a GGUF's one-time conversion, as progress the loading screen shows
                     "nanoserve.labs.plug"}   # `--lab`: a student's step explained, and its invariants checked per step
# viz/repl.py draws the engine's Displayable objects, so it names their classes to register its renderers.
DISPLAYABLE = {"nanoserve.engine", "nanoserve.block_pool", "nanoserve.radix_cache", "nanoserve.outputs"}
FRONT_ENDS = ("nanoserve.cli", "nanoserve.serve")   # programs people run; they may start any viewer
# The what-if tools sit beside the engine as the scenarios do: the live TUI drives a whatif Run as it drove a
# ScenarioRunner (rewind and branch replay its command log), and the comparison view reads their metrics and
# comparisons, which are built from traces.
VIEWER_MAY_IMPORT_PACKAGES = ("nanoserve.whatif",)
# `nanoserve web`'s command line lives beside the TUI it serves, but is a program people run, like cli.py: it
# takes the engine flags (engine_flags.py) and shares `serve`'s words (its API key variable, loopback hosts).
VIEWER_FRONT_ENDS = {"nanoserve_tui.web_command": {"nanoserve.engine_flags", "nanoserve.serve.command"}}


def module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(PACKAGES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(pkg, p): p for pkg, root in PACKAGES.items() for p in root.rglob("*.py")}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `path` imports (a name imported from a package counts as its submodule),
    type-only imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_no_import_cycle():
    edges, done, path = graph(), set(), []

    def visit(node: str) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        path.append(node)
        for dep in sorted(edges[node]):
            if not dep.startswith(node + "."):     # a package's __init__ naming its own submodule is fine
                visit(dep)
        path.pop()
        done.add(node)

    for name in sorted(edges):
        visit(name)


def test_the_engine_never_imports_its_viewers():
    for name, deps in graph().items():
        if name.startswith(("nanoserve.viz", "nanoserve_tui")) or name.startswith(FRONT_ENDS):
            continue
        viewers = sorted(d for d in deps if d.startswith(("nanoserve.viz", "nanoserve_tui")))
        assert not viewers, f"{name} imports {viewers}: register a renderer from the viewer side (display.py)"


def test_viewers_read_only_events_views_and_the_public_api():
    for name, deps in graph().items():
        if not name.startswith(("nanoserve.viz", "nanoserve_tui")):
            continue
        allowed = VIEWER_MAY_IMPORT | (DISPLAYABLE if name == "nanoserve.viz.repl" else set()) \
            | VIEWER_FRONT_ENDS.get(name, set())
        beside = ("nanoserve.viz", "nanoserve_tui", *VIEWER_MAY_IMPORT_PACKAGES)
        engine_side = sorted(d for d in deps if not d.startswith(beside) and d not in allowed)
        assert not engine_side, f"{name} reaches into the engine: {engine_side}"


def test_every_displayable_class_has_a_renderer():
    from nanoserve import LLMEngine
    from nanoserve.block_pool import BlockPool
    from nanoserve.display import Displayable, renderer_for
    from nanoserve.outputs import RequestOutput, StepResult
    from nanoserve.radix_cache import RadixCache

    for cls in (LLMEngine, BlockPool, RadixCache, RequestOutput, StepResult):
        assert issubclass(cls, Displayable)
        probe = cls.__new__(cls)                 # no engine needed: the lookup is by class
        assert renderer_for(probe) is not None, cls.__name__


def test_only_the_resolver_imports_the_cpu_fast_path():
    """nanoserve/cpu/ is wired in at one place (implementation.build, which the runner calls), so the code a
    student reads elsewhere is the code that runs, and the engine can say which parts the fast path replaced."""
    for name, deps in graph().items():
        if name.startswith("nanoserve.cpu") or name == "nanoserve.implementation":
            continue
        cpu = sorted(d for d in deps if d == "nanoserve.cpu" or d.startswith("nanoserve.cpu."))
        assert not cpu, f"{name} imports {cpu}: only nanoserve.implementation may import the CPU fast path"


def test_only_the_engine_touches_its_private_state():
    """Modules that are handed an engine (intake, llm, the front ends, ...) use its public attributes and
    verbs (`add_request`, `step`, `table`, `emit`, ...), never `engine._something`."""
    offenders = []
    for name, path in modules().items():
        if name == "nanoserve.engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
                if owner_name == "engine":
                    offenders.append(f"{name}:{node.lineno} engine.{node.attr}")
    assert not offenders, "private engine state used outside engine.py: " + ", ".join(offenders)


def below_the_engine() -> set[str]:
    """Every module engine.py imports, directly or through others."""
    edges, seen, todo = graph(), set(), ["nanoserve.engine"]
    while todo:
        for dep in edges[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen - {"nanoserve.engine"}


def test_nothing_below_the_engine_imports_it():
    """The engine conducts the step and its parts never call back: no module engine.py imports (directly or
    not) imports engine.py, not even for a type. (The import cycle test would also fail; this says where.)"""
    edges = graph()
    back = sorted(name for name in below_the_engine() if "nanoserve.engine" in edges[name])
    assert not back, f"{back} import nanoserve.engine, which imports them: pass them the parts they need"


STEP_HELPERS = ("commit", "token_choice", "request_table", "step_rollback", "engine_state")


def test_the_steps_helpers_take_parts_not_the_engine():
    """The step's helper modules are given the parts they read (the request table, the scheduler, the KV
    manager, ...), so commit flows one way: engine -> commit -> request table -> scheduler / detokenizer."""
    takers = []
    for name in STEP_HELPERS:
        module = f"nanoserve.{name}"
        assert module in below_the_engine(), f"{module} is no longer imported by the engine: update STEP_HELPERS"
        for fn in ast.walk(ast.parse(modules()[module].read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                takers += [f"{name}.{fn.name}" for arg in fn.args.args + fn.args.kwonlyargs if arg.arg == "engine"]
    assert not takers, f"these take the whole engine: {takers}"


def methods(module: str, cls: str) -> set[str]:
    tree = ast.parse(modules()[module].read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.name for n in body if isinstance(n, ast.FunctionDef)}


def test_the_commit_verbs_belong_to_the_request_table():
    """Appending, forking, pruning, trimming and finishing are the request table's; the engine calls none of them
    itself (its public `fork` and `abort_request` check the caller's input, then hand over to the table)."""
    verbs = {"append", "append_token", "append_tokens", "fork_sequence", "prune", "prune_beam", "accept_drafts",
             "count_verified", "finish", "finish_sequence", "fail"}
    in_engine = methods("nanoserve.engine", "LLMEngine") & verbs
    assert not in_engine, f"commit verbs in engine.py: {sorted(in_engine)}: they belong to RequestTable"
    assert {"append", "fork", "prune", "accept_drafts", "finish"} <= methods("nanoserve.request_table", "RequestTable")
