"""Mutants of a lab's solution: one small change in a body the student writes, to test the checks.

`mutants(lab)` takes the engine's own module (the reference solution, which
passes every check) and yields one `Mutant` per change, each a whole module
source that differs from the engine's in one place, inside one of the lab's
blanks (never in the code the starter keeps, never in a docstring):

    compare     <  <=  >  >=  ==  !=  is  is not  in  not in   flipped to its neighbour or opposite
    boolop      and <-> or
    negate      an if/while/ternary condition, `not` added (or an existing `not` removed)
    constant    an integer moved by one (up and down); True <-> False
    binop       + <-> -, * <-> //, // <-> *, % -> //; += <-> -=
    call        min <-> max (tl.maximum <-> tl.minimum too); reversed(x) -> x; list(x) -> x (an alias)
    drop        a statement replaced by `pass` (a raise, an assignment, a call, a whole if or loop)
    return      `return value` -> `return None`; break <-> continue

Strings are never changed, and nothing inside `assert` or inside the arguments
of a `raise` is (an error's text is not a rule of any lab). A mutant is killed
when `nanoserve lab check` fails on it; one that passes either shows a rule
the checks miss, or is equivalent (behaviour provably unchanged), which the
lab's bug file lists with a reason (tests/lab_bugs/). The runner is
benchmarks/lab_mutation.py.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

from nanoserve.labs.starter import _functions

COMPARE = {ast.Lt: [ast.LtE, ast.GtE], ast.LtE: [ast.Lt, ast.Gt], ast.Gt: [ast.GtE, ast.LtE],
           ast.GtE: [ast.Gt, ast.Lt], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.Is: [ast.IsNot],
           ast.IsNot: [ast.Is], ast.In: [ast.NotIn], ast.NotIn: [ast.In]}
BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
SWAP_NAMES = {"min": "max", "max": "min", "maximum": "minimum", "minimum": "maximum"}


@dataclass(frozen=True, slots=True)
class Mutant:
    lab: str
    function: str        # the blank it changes, e.g. "BlockPool.free"
    line: int            # where, in the engine's module
    kind: str            # one of the operators of the module docstring
    before: str          # the changed piece of code, before ...
    after: str           # ... and after
    key: str             # stable name: function, kind, the source line, before -> after (#n when that repeats)
    source: str          # the whole mutated module

    @property
    def label(self) -> str:
        return f"{self.function} line {self.line}: {self.before}  ->  {self.after}"


def body_nodes(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
            isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _sites(fn: ast.FunctionDef) -> Iterator[tuple[tuple, str, object]]:
    """(path to a node from `fn`, kind, replacement) for every mutation inside the body, in source order."""
    def visit(node, path):
        if isinstance(node, (ast.Assert, ast.JoinedStr)):
            return
        if isinstance(node, ast.Raise):
            yield path, "drop", None
            return                       # the exception and its message stay as they are
        yield from _at(node, path)
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                for i, child in enumerate(value):
                    if isinstance(child, ast.AST):
                        yield from visit(child, path + ((field, i),))
            elif isinstance(value, ast.AST):
                yield from visit(value, path + ((field, None),))

    start = fn.body.index(body_nodes(fn)[0]) if body_nodes(fn) else len(fn.body)
    for i in range(start, len(fn.body)):
        yield from visit(fn.body[i], (("body", i),))


def _at(node, path) -> Iterator[tuple[tuple, str, object]]:
    if isinstance(node, ast.stmt) and not isinstance(node, ast.Pass):
        yield path, "drop", None
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in COMPARE.get(type(op), ()):
                yield path, "compare", (i, new)
    if isinstance(node, ast.BoolOp):
        yield path, "boolop", ast.Or if isinstance(node.op, ast.And) else ast.And
    if isinstance(node, (ast.If, ast.While, ast.IfExp)) and not isinstance(node.test, ast.Constant):
        yield path, "negate", None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield path, "negate", "remove"
    if isinstance(node, ast.Constant) and type(node.value) is int:
        yield path, "constant", node.value + 1
        yield path, "constant", node.value - 1
    if isinstance(node, ast.Constant) and type(node.value) is bool:
        yield path, "constant", not node.value
    if isinstance(node, ast.BinOp) and type(node.op) in BINOP:
        yield path, "binop", BINOP[type(node.op)]
    if isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub):
        yield path, "binop", ast.Sub if isinstance(node.op, ast.Add) else ast.Add
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else \
            node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name in SWAP_NAMES:
            yield path, "call", SWAP_NAMES[name]
        if name in ("reversed", "list") and isinstance(node.func, ast.Name) and len(node.args) == 1:
            yield path, "call", "unwrap"
    if isinstance(node, ast.Return) and node.value is not None and \
            not (isinstance(node.value, ast.Constant) and node.value.value is None):
        yield path, "return", None
    if isinstance(node, (ast.Break, ast.Continue)):
        yield path, "return", "swap"


def _locate(fn: ast.FunctionDef, path: tuple):
    """(parent, field, index, node) for the node at `path` below `fn`."""
    parent, field, index, node = None, None, None, fn
    for field, index in path:
        parent = node
        node = getattr(parent, field) if index is None else getattr(parent, field)[index]
    return parent, field, index, node


def _apply(fn: ast.FunctionDef, path: tuple, kind: str, arg) -> tuple[str, str]:
    """Change the copy `fn` at `path`; returns (before, after) as source text."""
    parent, field, index, node = _locate(fn, path)
    before = ast.unparse(node)

    def put(new):
        if index is None:
            setattr(parent, field, new)
        else:
            getattr(parent, field)[index] = new
        return new

    if kind == "drop":
        new = put(ast.Pass())
        return before.splitlines()[0] + (" ..." if "\n" in before else ""), "pass"
    if kind == "compare":
        i, op = arg
        node.ops[i] = op()
        new = node
    elif kind == "boolop":
        node.op = arg()
        new = node
    elif kind == "negate":
        if arg == "remove":
            new = put(node.operand)
        else:
            node.test = ast.UnaryOp(ast.Not(), node.test)
            new = node
    elif kind == "constant":
        new = put(ast.Constant(arg))
    elif kind == "binop":
        node.op = arg()
        new = node
    elif kind == "call":
        if arg == "unwrap":
            new = put(node.args[0])
        elif isinstance(node.func, ast.Name):
            node.func.id = arg
            new = node
        else:
            node.func.attr = arg
            new = node
    elif kind == "return":
        if arg == "swap":
            new = put(ast.Continue() if isinstance(node, ast.Break) else ast.Break())
        else:
            node.value = ast.Constant(None)
            new = node
    else:
        raise ValueError(kind)
    after = ast.unparse(new)
    return (before if kind != "negate" or arg == "remove" else ast.unparse(_locate(fn, path)[3].test.operand)), \
        (after if kind != "negate" or arg == "remove" else ast.unparse(node.test))


def mutants(lab) -> Iterator[Mutant]:
    """Every mutant of `lab`'s blanks, in the order of the module's source."""
    module = importlib.import_module(lab.module)
    source = inspect.getsource(module)
    lines = source.splitlines()
    tree = ast.parse(source)
    fns = _functions(tree)
    seen: dict[str, int] = {}
    for qualname in sorted(lab.blanks, key=lambda q: fns[q].lineno):
        original = fns[qualname]
        start = original.decorator_list[0].lineno if original.decorator_list else original.lineno
        indent = " " * original.col_offset
        for path, kind, arg in _sites(original):
            fn = copy.deepcopy(original)
            line = _locate(original, path)[3].lineno
            before, after = _apply(fn, path, kind, arg)
            ast.fix_missing_locations(fn)
            text = "\n".join(indent + row if row else row for row in ast.unparse(fn).splitlines())
            new_source = "\n".join(lines[: start - 1] + [text] + lines[original.end_lineno:]) + "\n"
            context = lines[line - 1].strip()
            key = f"{qualname}:{kind}: {context} :: {' '.join(before.split())} -> {' '.join(after.split())}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                key += f" #{seen[key]}"
            yield Mutant(lab.name, qualname, line, kind, before, after, key, new_source)
