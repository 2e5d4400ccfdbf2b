"""The worker's audit hook: the roads around the blanked module (`blanks.py`), closed while a check runs.

`lock(withheld, paths)` is called once, after torch and the engine's modules
are loaded and just before the student's file is imported (the capstone names
every part's file, and withholds every part's module). It installs a
`sys.addaudithook` hook, which no Python code can remove, that refuses (PermissionError, whose message says "this check runs your code"):

* opening the engine's source of the lab's module or its cached bytecode, by
  any name (a symlink, a hard link, another copy of nanoserve: the same
  file, or a file of the same name that is not the student's), and any
  process's memory (`/proc/*/mem`);
* compiling source, loading marshalled code or building a code object that
  holds a blank's body (the normalised-AST and bytecode fingerprints of
  `blanks.py`) unless the student's own file holds that same body (then it is
  theirs, copied or not: `identical` flags it in the checker);
* starting a program (`subprocess`, `os.system`, `os.exec*`, `posix_spawn`):
  a new program has no audit hook, and could read the source for us;
* ctypes' doors to raw memory and C functions (loading a library, reading
  an address, calling a foreign function), and `gc`'s object graph (the road
  to the hook's own state).

The hook's state lives in this function's closure, with the builtins it uses
bound there, so patching a module (`os.path`, `ast`, `builtins`) from the
student's file does not change what it checks. What it cannot stop is said on
the teacher's page.
"""

from __future__ import annotations

import ast
import hashlib
import marshal
import os
import sys
from pathlib import Path

from nanoserve_labkit.blanks import PHRASE, Withheld, body_prints, code_prints, printers

PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                            "os.startfile", "pty.spawn"})
CTYPES_EVENTS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.string_at",
                           "ctypes.wstring_at", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof"})
GC_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
CODE_EVENTS = frozenset({"compile", "exec", "marshal.loads", "code.__new__"})
FILE_EVENTS = frozenset({"open", "os.link", "os.symlink", "os.rename"})
REFUSED_IMPORTS = frozenset({"_posixsubprocess"})


def lock(withheld: list[Withheld], paths: list[str | Path]) -> None:
    """Install the hook for the student's files at `paths` (the lab's file; the capstone: every part's) around
    the modules in `withheld` (once per worker; it stays until the process ends)."""
    own_bodies, own_codes, own_bytecodes, mine = set(), set(), set(), set()
    for path in paths:
        student = Path(path).resolve()
        try:
            source = student.read_text()
            st = os.stat(student)
            mine.add((st.st_dev, st.st_ino))
        except (OSError, UnicodeDecodeError):       # (the import that follows says what is wrong with the file)
            source = ""
        try:
            tree = ast.parse(source)
            code = compile(tree, str(student), "exec")
        except (SyntaxError, ValueError):
            continue
        own_bodies |= body_prints(tree)
        own_codes |= code_prints(code)
        own_bytecodes |= {hashlib.sha256(c).hexdigest() for c in _bytecodes(code)}
    bodies = frozenset().union(*(w.bodies for w in withheld)) - own_bodies
    codes = frozenset().union(*(w.codes for w in withheld)) - own_codes
    bytecodes = frozenset().union(*(w.bytecodes for w in withheld)) - own_bytecodes
    protected = set()
    for f in (f for w in withheld for f in w.files):
        try:
            st = os.stat(f)
            protected.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    stems = [Path(w.origin).stem for w in withheld]
    names = frozenset(stem + ".py" for stem in stems)
    pyc_prefixes = tuple(stem + "." for stem in stems)
    proc_dev = os.stat("/proc").st_dev if os.path.isdir("/proc") else -1
    protected = frozenset(protected - mine)
    mine = frozenset(mine)
    _posixsubprocess = sys.modules.get("_posixsubprocess")
    if _posixsubprocess is not None:                # its fork_exec starts a program without an audit event
        def fork_exec(*args, **kwargs):
            raise PermissionError(f"{PHRASE}: it starts no other program here")
        _posixsubprocess.fork_exec = fork_exec
    files = " and ".join(sorted(names))
    hook = _make_hook(message=f"{PHRASE}; the engine's own {files} is not available here", protected=protected,
                      names=names, pyc_prefixes=pyc_prefixes, mine=mine, proc_dev=proc_dev, bodies=bodies,
                      codes=codes, bytecodes=bytecodes)
    sys.addaudithook(hook)


def _make_hook(message, protected, names, pyc_prefixes, mine, proc_dev, bodies, codes, bytecodes):
    """The hook, with everything it reads bound in its closure."""
    _stat, _fspath, _isinstance, _str, _bytes, _hasattr = os.stat, os.fspath, isinstance, str, bytes, hasattr
    _compile, _loads, _sha, _error, _ast_flag, _AST = compile, marshal.loads, hashlib.sha256, PermissionError, \
        ast.PyCF_ONLY_AST, ast.AST
    body_print, code_print, defs = printers()
    process_events, ctypes_events, gc_events = PROCESS_EVENTS, CTYPES_EVENTS, GC_EVENTS
    code_events, file_events, refused_imports = CODE_EVENTS, FILE_EVENTS, REFUSED_IMPORTS
    busy = [0]

    def refuse(what):
        raise _error(f"{message} ({what})")

    def is_protected(path):
        if _isinstance(path, int) or path is None:
            return False
        try:
            path = _fspath(path)
        except TypeError:
            return False
        text = path.decode("utf-8", "replace") if _isinstance(path, _bytes) else _str(path)
        base = text.rstrip("/").rpartition("/")[2]
        try:
            st = _stat(path)
            key = (st.st_dev, st.st_ino)
        except (OSError, ValueError):
            st, key = None, None
        if key is not None and key in mine:
            return False
        if key is not None and key in protected:
            return True
        if base in names or (base.startswith(pyc_prefixes) and base.endswith(".pyc")):
            return True                                        # another copy of the engine's module
        if base == "mem" and (st is None or st.st_dev == proc_dev):
            return True                                        # a process's memory
        return False

    def tree_holds_a_blank(tree):
        return any(body_print(fn) in bodies for fn in defs(tree))

    def code_holds_a_blank(code):
        todo = [code]
        while todo:
            c = todo.pop()
            if code_print(c) in codes:
                return True
            todo += [k for k in c.co_consts if _hasattr(k, "co_code")]
        return False

    def check_code(event, args):
        if event == "compile":
            source = args[0]
            if _isinstance(source, _AST):
                return tree_holds_a_blank(source)
            if _isinstance(source, (_str, _bytes)):
                try:
                    return tree_holds_a_blank(_compile(source, "<lab>", "exec", _ast_flag))
                except (SyntaxError, ValueError):
                    return False
            return False
        if event == "exec":
            return _hasattr(args[0], "co_code") and code_holds_a_blank(args[0])
        if event == "marshal.loads":
            try:
                value = _loads(args[0])
            except (ValueError, EOFError, TypeError):
                return False
            return _hasattr(value, "co_code") and code_holds_a_blank(value)
        if event == "code.__new__":                          # (bytecode, filename, name, ...)
            return _isinstance(args[0], _bytes) and _sha(args[0]).hexdigest() in bytecodes
        return False

    def hook(event, args):
        if busy[0]:
            return
        if event in file_events:
            if is_protected(args[0]):
                refuse(f"{event} {args[0]!r}")
        elif event in code_events:
            busy[0] += 1
            try:
                bad = check_code(event, args)
            finally:
                busy[0] -= 1
            if bad:
                refuse(f"{event} of code that holds the engine's own body of a function you write")
        elif event in process_events:
            refuse(f"{event}: it starts no other program here")
        elif event in ctypes_events:
            refuse(f"{event}: no raw memory or C calls here")
        elif event in gc_events:
            refuse(f"{event}: the object graph is not open here")
        elif event == "import" and args[0] in refused_imports:
            refuse(f"import {args[0]}")

    return hook


def _bytecodes(code) -> list[bytes]:
    out, todo = [], [code]
    while todo:
        c = todo.pop()
        out.append(c.co_code)
        todo += [k for k in c.co_consts if hasattr(k, "co_code")]
    return out
