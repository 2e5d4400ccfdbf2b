"""The engine's module with the lab's bodies withheld, and what "the engine's own code" looks like.

A check judges the student's code, so the worker must not hold the engine's
implementation of what the student is asked to write. Yet the worker needs
the engine's module (the student's file imports its types, `signature`
checks read its signatures). `install([(module, qualnames), ...])` puts a finder
first on `sys.meta_path`, before anything imports the module: from then on
importing it, however it is spelled (`import`, `importlib`, `reload`, after
deleting it from `sys.modules`), gives a copy of the engine's module in
which each blank's body is one line:

    raise RuntimeError("this check runs your code; the engine's own `KVManager.fork` is not available here")

The copy keeps every other line (line numbers too) and is compiled under a
file name of its own, so `inspect.getsource` of a blank shows the withheld
body, never the engine's. The engine's source is read once, here, to make the
copy and the fingerprints below, and dropped.

Fingerprints: a blank's body, normalised (docstring dropped, its local
names renamed in order of appearance) and hashed, and its code object's
bytecode, names and constants hashed. `guard.py` refuses code carrying these
that did not come from the student's file; `identical(lab, path)` (the
checker) names the blanks a submission copied from the engine verbatim.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import sys
from dataclasses import dataclass, field
from pathlib import Path

PHRASE = "this check runs your code"
HINT = ("write these bodies yourself: your file may import what a solution may (typing, collections, the "
        "engine's other modules and the types of this one), but not the engine's answer")
COPY_SUFFIX = " (the lab's copy: the bodies you write are withheld)"


def withheld_text(qualname: str) -> str:
    return f"{PHRASE}; the engine's own `{qualname}` is not available here"


def verdict(exc: BaseException | str | None) -> str | None:
    """The "not your code" sentence carried by `exc` (or its causes), else None."""
    if isinstance(exc, str):
        start = exc.find(PHRASE)
        return " ".join(exc[start:].split()) if start >= 0 else None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = verdict(str(exc))
        if found:
            return found
        exc = exc.__cause__ or exc.__context__
    return None


# -- the blanked copy -------------------------------------------------------------------------------


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """qualname -> def node, for module-level functions and methods of module-level classes."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = item
    return out


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    first = fn.body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    return fn.body[1:] if doc else fn.body


def blank_source(source: str, qualnames) -> str:
    """`source` with each blank's body (after its docstring) one `raise`, padded so that line numbers stay."""
    lines = source.splitlines()
    fns = functions(ast.parse(source))
    missing = set(qualnames) - set(fns)
    if missing:
        raise ValueError(f"no {sorted(missing)} to withhold")
    for qualname in sorted(qualnames, key=lambda q: -fns[q].lineno):
        body = _body(fns[qualname])
        if not body:
            continue
        start, end = body[0].lineno, fns[qualname].end_lineno
        if start == fns[qualname].lineno:
            raise ValueError(f"{qualname}: a body on its def line cannot be withheld line for line")
        indent = " " * body[0].col_offset
        lines[start - 1:end] = [f"{indent}raise RuntimeError({withheld_text(qualname)!r})"] + [""] * (end - start)
    return "\n".join(lines) + "\n"


# -- fingerprints ---------------------------------------------------------------------------------


def printers():
    """(body_print, code_print, defs), bound now to the builtins and the `ast` classes' fields as they are.

    body_print(fn): a hash of a def node's body, normalised (no docstring, its local names renamed v0,
    v1, ... in order of appearance; None for an empty body, `pass` or one `raise`); code_print(code): a
    hash of a code object's bytecode, names and constants; defs(tree): every def node in a tree. The
    worker's audit hook makes its own set after torch has loaded and before the student's file runs,
    so a module the student patches later (`ast`, `hashlib`, `builtins`) does not change them."""
    _isinstance, _type, _getattr, _repr, _str, _len, _hasattr = isinstance, type, getattr, repr, str, len, hasattr
    _sha, _AST, _Name, _Store, _Del, _Expr, _Constant = hashlib.sha256, ast.AST, ast.Name, ast.Store, ast.Del, \
        ast.Expr, ast.Constant
    _defs, _empty = (ast.FunctionDef, ast.AsyncFunctionDef), (ast.Pass, ast.Raise)
    fields = {}
    todo = [ast.AST]
    while todo:
        cls = todo.pop()
        fields[cls] = tuple(cls._fields)
        todo += cls.__subclasses__()

    def children(node):
        if _isinstance(node, _AST):
            return [_getattr(node, name, None) for name in fields.get(_type(node), ())]
        return node if _isinstance(node, list) else []

    def defs(tree):
        out, todo = [], [tree]
        while todo:
            node = todo.pop()
            if _isinstance(node, _defs):
                out.append(node)
            todo += children(node)
        return out

    def dump(node, local, renamed, out):
        if _isinstance(node, _AST):
            t = _type(node)
            if t is _Name and node.id in local:
                out.append("Name(" + renamed.setdefault(node.id, "v" + _str(_len(renamed))) + ",")
            else:
                out.append(t.__name__ + "(")
                if t is _Name:
                    out.append(_repr(node.id) + ",")
            for name in fields.get(t, ()):
                if t is not _Name or name != "id":
                    dump(_getattr(node, name, None), local, renamed, out)
                    out.append(",")
            out.append(")")
        elif _isinstance(node, list):
            out.append("[")
            for item in node:
                dump(item, local, renamed, out)
                out.append(",")
            out.append("]")
        else:
            out.append(_repr(node))

    def body_print(fn):
        body = fn.body
        if body and _type(body[0]) is _Expr and _isinstance(body[0].value, _Constant) and \
                _isinstance(body[0].value.value, _str):
            body = body[1:]
        if not body or (_len(body) == 1 and _isinstance(body[0], _empty)):
            return None
        a = fn.args
        local = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}
        todo = list(body)
        while todo:
            node = todo.pop()
            if _type(node) is _Name and _isinstance(node.ctx, (_Store, _Del)):
                local.add(node.id)
            todo += children(node)
        out = []
        dump(body, local, {}, out)
        return _sha("".join(out).encode()).hexdigest()

    def code_print(code):
        consts = tuple(_repr(c) for c in code.co_consts if not _hasattr(c, "co_code"))
        return _sha(_repr((code.co_code, code.co_names, consts)).encode()).hexdigest()

    return body_print, code_print, defs


body_print, code_print, _defs = printers()


def body_prints(tree: ast.AST) -> set[str]:
    """The body hash of every function in `tree` (nested ones too)."""
    return {p for node in _defs(tree) for p in [body_print(node)] if p}


def code_prints(code, qualnames=None) -> set[str]:
    """The hash of every code object inside `code` (only those named `qualnames`, when given)."""
    out, todo = set(), [code]
    while todo:
        c = todo.pop()
        if qualnames is None or c.co_qualname in qualnames:
            out.add(code_print(c))
        todo += [k for k in c.co_consts if hasattr(k, "co_code")]
    return out


def bytecode_prints(code, qualnames) -> set[str]:
    """The hash of the bare bytecode of each code object inside `code` named `qualnames`."""
    out, todo = set(), [code]
    while todo:
        c = todo.pop()
        if c.co_qualname in qualnames:
            out.add(hashlib.sha256(c.co_code).hexdigest())
        todo += [k for k in c.co_consts if hasattr(k, "co_code")]
    return out


# -- the finder -----------------------------------------------------------------------------------


@dataclass
class Withheld:
    """One engine module served blanked: where it is, its copy, and its blanks' fingerprints."""

    module: str
    qualnames: tuple[str, ...]
    origin: str = ""                          # the engine's source file
    source: str = ""                          # the blanked copy
    bodies: frozenset = frozenset()           # body_print of each blank
    codes: frozenset = frozenset()            # code_print of each blank
    bytecodes: frozenset = frozenset()        # the hash of each blank's bare bytecode
    files: tuple[str, ...] = field(default_factory=tuple)   # the source and its cached bytecode files

    @property
    def filename(self) -> str:
        return self.origin + COPY_SUFFIX


class BlankingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on sys.meta_path: the withheld modules come from their blanked copies."""

    def __init__(self, withheld: Withheld) -> None:
        self.withheld = withheld

    def find_spec(self, fullname, path=None, target=None):
        w = self.withheld
        if fullname != w.module:
            return None
        if not w.source:
            self._prepare(fullname, path)
        return importlib.util.spec_from_loader(fullname, self, origin=w.origin)

    def _prepare(self, fullname, path) -> None:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ImportError(f"the lab cannot withhold {fullname}: no source file", name=fullname)
        w = self.withheld
        w.origin = spec.origin
        source = Path(spec.origin).read_text()
        tree = ast.parse(source)
        fns = functions(tree)
        w.bodies = frozenset(p for q in w.qualnames for p in [body_print(fns[q])] if p)
        code = compile(tree, spec.origin, "exec")
        w.codes = frozenset(code_prints(code, set(w.qualnames)))
        w.bytecodes = frozenset(bytecode_prints(code, set(w.qualnames)))
        w.source = blank_source(source, w.qualnames)
        cached = Path(spec.origin).parent / "__pycache__"
        stem = Path(spec.origin).stem
        w.files = (spec.origin, *sorted(str(p) for p in cached.glob(f"{stem}.*.pyc")))
        del source, tree, fns, code

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        w = self.withheld
        linecache.cache[w.filename] = (len(w.source), None, w.source.splitlines(True), w.filename)
        module.__file__ = w.filename           # (inspect.getsource(module) reads the copy, from linecache)
        exec(compile(w.source, w.filename, "exec"), module.__dict__)

    def get_source(self, fullname):
        return self.withheld.source


def install(specs) -> list[Withheld]:
    """Serve each module of `specs` ((module, qualnames) pairs; one module named twice has its blanks joined)
    blanked from now on; call before anything imports them. Every finder is in place before the first import
    (one withheld module may import another). Returns what is withheld, one Withheld per module."""
    joined: dict[str, list[str]] = {}
    for module, qualnames in specs:
        names = joined.setdefault(module, [])
        names += [q for q in qualnames if q not in names]
    withheld = []
    for module, qualnames in joined.items():
        if module in sys.modules:
            raise RuntimeError(f"{module} was imported before its bodies could be withheld")
        finder = BlankingFinder(Withheld(module, tuple(qualnames)))
        sys.meta_path.insert(0, finder)
        withheld.append(finder.withheld)
    for w in withheld:
        importlib.import_module(w.module)
    return withheld


def classes(*labs) -> frozenset[tuple[str, str]]:
    """(module, class) of each class the student writes methods of: the checker never hands one to the worker."""
    return frozenset((lab.module, q.split(".")[0]) for lab in labs for q in lab.blanks if "." in q)


def spec_arg(lab) -> str:
    """The worker's argument that names what to withhold: `withhold:MODULE:QUAL,QUAL` (one per lab; the
    capstone's worker gets one for every part the student wrote)."""
    return f"withhold:{lab.module}:{','.join(lab.blanks)}"


def parse_spec_arg(arg: str) -> tuple[str, list[str]] | None:
    kind, _, rest = arg.partition(":")
    if kind != "withhold":
        return None
    module, _, names = rest.partition(":")
    return module, [n for n in names.split(",") if n]


# -- the checker's side: verbatim copies, and where a blank's code comes from -----------------------


def identical(lab, path: str | Path | None = None, source: str | None = None) -> list[str]:
    """The blanks whose bodies in the file at `path` (or in `source`, a file's text) equal the engine's
    (normalised AST)."""
    spec = importlib.util.find_spec(lab.module)
    try:
        mine = functions(ast.parse(source if source is not None else Path(path).read_text()))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return []
    engine = functions(ast.parse(Path(spec.origin).read_text()))
    out = []
    for qualname in lab.blanks:
        if qualname in mine and qualname in engine:
            want = body_print(engine[qualname])
            if want is not None and body_print(mine[qualname]) == want:
                out.append(qualname)
    return out


def foreign_blanks(module, qualnames, path: str | Path) -> list[tuple[str, str]]:
    """(qualname, where its code comes from) for each blank of `module` whose code is not from `path`."""
    from nanoserve.labs.starter import resolve

    target = str(Path(path).resolve())
    out = []
    for qualname in qualnames:
        fn = resolve(module, qualname)
        fn = getattr(fn, "fn", fn)                       # a @triton.jit function: its Python one
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        code = getattr(fn, "__code__", None)
        if code is None or not isinstance(code.co_filename, str):
            continue
        name = code.co_filename
        if name.endswith(COPY_SUFFIX):
            name = name[:-len(COPY_SUFFIX)]
        try:
            resolved = str(Path(name).resolve())
        except (OSError, RuntimeError, ValueError):
            resolved = name
        if resolved != target:
            out.append((qualname, name))
    return out


def own_code(module, qualnames, path: str | Path) -> None:
    """LoadError ("this check runs your code...") when a blank of `module` is not written in the file at `path`."""
    from nanoserve.labs.load import LoadError

    foreign = foreign_blanks(module, qualnames, path)
    if foreign:
        qualname, origin = foreign[0]
        raise LoadError(f"{withheld_text(qualname)}: {Path(path).name} takes it from {Path(origin).name} "
                        "instead of writing it")
