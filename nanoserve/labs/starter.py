"""Starters made from the engine's own modules, so they cannot drift from it.

`starter_source(lab)` reads the real module's source and keeps it line for
line (docstrings, comments, every helper), except the bodies of the lab's
`blanks`: each becomes its docstring, a TODO comment and
`raise NotImplementedError(...)`. With `lab.keep` set, only those top-level
definitions (and the module's imports) are kept. In design mode
(`starter_source(lab, "design")`) a body gets its contract instead of a TODO
(what must hold, not how), and the header states the lab's invariants.

`signature_mismatches(lab, module)` compares a student's functions with the
engine's: a renamed argument would break the engine at its first call, so
the first check of every lab runs it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from types import ModuleType


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """qualname -> def node, for module-level functions and methods of module-level classes."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = item
    return out


def _blank(lines: list[str], fn: ast.FunctionDef, qualname: str, todo: str, label: str = "TODO") -> list[str]:
    """The lines of `fn` with its body after the docstring replaced by a TODO (or a contract) and a raise."""
    first = fn.body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    head_end = first.end_lineno if has_doc else first.lineno - 1     # 1-based, inclusive
    start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
    indent = " " * first.col_offset
    wrapped = textwrap.wrap(todo, 100 - len(indent) - len(label) - 4)
    todo_lines = [f"{indent}# {label if i == 0 else ' ' * len(label)}: {line}".rstrip() if i == 0 else
                  f"{indent}# {' ' * len(label)}  {line}".rstrip() for i, line in enumerate(wrapped)]
    return lines[start - 1 : head_end] + todo_lines + \
        [f'{indent}raise NotImplementedError("{qualname}: your code goes here")']


def starter_source(lab, mode: str = "guided") -> str:
    """The starter file for `lab`, made from the engine's module `lab.module` (mode: "guided" or "design")."""
    if mode not in ("guided", "design"):
        raise ValueError(f"mode must be guided or design, got {mode!r}")
    design = mode == "design"
    module = importlib.import_module(lab.module)
    source = inspect.getsource(module)
    lines = source.splitlines()
    tree = ast.parse(source)
    fns = _functions(tree)
    missing = set(lab.blanks) - set(fns)
    if missing:
        raise ValueError(f"lab {lab.name}: {lab.module} has no {sorted(missing)}")
    # Replace from the bottom up so earlier line numbers stay valid.
    for qualname in sorted(lab.blanks, key=lambda q: -fns[q].lineno):
        fn = fns[qualname]
        start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
        text = lab.contracts.get(qualname, lab.blanks[qualname]) if design else lab.blanks[qualname]
        lines[start - 1 : fn.end_lineno] = _blank(lines, fn, qualname, text, "Contract" if design else "TODO")
    if lab.keep is not None:
        tree = ast.parse("\n".join(lines))
        kept = []
        for node in tree.body:
            is_import = isinstance(node, (ast.Import, ast.ImportFrom))
            name = getattr(node, "name", None)
            if is_import or name in lab.keep:
                start = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
                kept.append("\n".join(lines[start - 1 : node.end_lineno]) + ("" if is_import else "\n"))
        body = "\n".join(kept)
        doc = f'"""{lab.intro.strip()}\n"""\n\n' if lab.intro else ""
        return _design_header(lab) + doc + body.rstrip() + "\n" if design else doc + body.rstrip() + "\n"
    if design:
        return _design_header(lab) + "\n".join(lines) + "\n"
    header = f"# nanoserve lab {lab.name}: {lab.title}.\n# Fill in every TODO; `nanoserve lab check {lab.name}` judges it.\n"
    return header + "\n".join(lines) + "\n"


def _design_header(lab) -> str:
    """Design mode's header: the invariants, and that the how is the student's."""
    rows = [f"# nanoserve lab {lab.name}, design mode.",                  # (the title is not on line 1 or 2:
            "#",                                                         # "decoding: x" there would be read
            f"# {lab.title}.",                                           # as a source encoding)
            "# Each body you write states its contract: what must hold, not how. The data structures, the",
            "# helpers and the signatures are the engine's (it calls them); everything inside the bodies is",
            f"# yours. `nanoserve lab check {lab.name}` judges it with the same checks as the guided starter."]
    if lab.invariants:
        rows += ["#", "# Invariants:", "#"] + [f"#   {line}".rstrip() for line in lab.invariants.strip().splitlines()]
    return "\n".join(rows) + "\n"


def resolve(module: ModuleType, qualname: str):
    """`module.A.b` for qualname "A.b" (None when a part is missing)."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def signature_mismatches(lab, module: ModuleType) -> list[str]:
    """One line per blank the student's module lacks or whose signature differs from the engine's."""
    return signature_mismatches_of(lab.module, list(lab.blanks), module)


def signature_mismatches_of(engine_module: str, qualnames: list[str], module: ModuleType) -> list[str]:
    """`signature_mismatches` by names (the lab's worker runs it next to the student's module)."""
    real = importlib.import_module(engine_module)
    out = []
    for qualname in qualnames:
        want, got = resolve(real, qualname), resolve(module, qualname)
        want, got = getattr(want, "fn", want), getattr(got, "fn", got)   # a @triton.jit function: its Python one
        if got is None:
            out.append(f"{qualname} is missing")
            continue
        try:
            ws, gs = inspect.signature(want), inspect.signature(got)
        except (TypeError, ValueError):
            continue
        if list(ws.parameters) != list(gs.parameters):
            out.append(f"{qualname}{gs} should be {qualname}{ws}")
    return out
