"""A grade counts only the student's own code: every road to the engine's implementation of a lab's blanks
ends in a "this check runs your code" verdict, never a pass; the engine's module copied verbatim passes and is
flagged "identical"; a solution of the student's own that imports what a solution may is never flagged.

The worker imports the student's file in its own process (the audit hook cannot be removed once
installed), so these tests start real workers; block-pool's unit checks keep each one quick.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import marshal
import py_compile
import textwrap

import pytest

from nanoserve import block_pool
from nanoserve.labs import get_lab
from nanoserve_labkit.blanks import PHRASE, blank_source, identical
from nanoserve_labkit.run import run_checks

GOOD = inspect.getsource(block_pool)
ORIGIN = importlib.util.find_spec("nanoserve.block_pool").origin
BLANK_BODY = "BlockPool.allocate"


def unit_checks():
    lab = get_lab("block-pool")
    return dataclasses.replace(lab, checks=tuple(c for c in lab.checks if c.function or c.name.startswith("sig")))


def delegating(body: str) -> str:
    """GOOD with BlockPool.allocate's body replaced by `body` (a method of the same class)."""
    head, _, rest = GOOD.partition("    def allocate(self, n: int) -> list[int]:\n")
    assert rest, "block_pool.BlockPool.allocate changed its signature: update this test"
    doc_end = rest.index('"""', rest.index('"""') + 3) + 3
    after = rest[doc_end:]
    next_def = after.index("\n    def ")
    return head + "    def allocate(self, n: int) -> list[int]:\n" + rest[:doc_end] + "\n" + \
        textwrap.indent(textwrap.dedent(body), " " * 8) + after[next_def:]


ROUTES = {
    "star_import": "from nanoserve.block_pool import *\n",
    "import_module_setattr": "import importlib\n_m = importlib.import_module('nanoserve' + '.block_pool')\n"
                             "FreeBlockQueue, BlockPool = _m.FreeBlockQueue, _m.BlockPool\n",
    "only_when_checked": "import sys\nif 'nanoserve_labkit' in sys.modules:\n"
                         "    from nanoserve.block_pool import *\nelse:\n    raise SystemExit\n",
    "reload_after_delete": "import sys, importlib\nsys.modules.pop('nanoserve.block_pool', None)\n"
                           "import nanoserve.block_pool as _m\n_m = importlib.reload(_m)\n"
                           "FreeBlockQueue, BlockPool = _m.FreeBlockQueue, _m.BlockPool\n",
    "delegates_to_the_engine": delegating("from nanoserve import block_pool as engine\n"
                                          "return engine.BlockPool.allocate(self, n)"),
    "exec_of_the_source": f"exec(open({ORIGIN!r}).read())\n",
    "getsource_of_the_module": "import inspect\nimport nanoserve.block_pool as _m\nexec(inspect.getsource(_m))\n",
    "runpy": f"import runpy\nglobals().update(runpy.run_path({ORIGIN!r}))\n",
    "another_name_on_sys_path": f"import sys\nsys.path.insert(0, {str(ORIGIN.rsplit('/', 1)[0])!r})\n"
                                "from block_pool import *\n",
    "a_symlink": f"import os\nos.symlink({ORIGIN!r}, 'copy.py')\nexec(open('copy.py').read())\n",
    "cached_bytecode": "import glob, marshal, os\n"
                       f"for p in glob.glob(os.path.join({ORIGIN.rsplit('/', 1)[0]!r}, '__pycache__', 'block_pool.*')):\n"
                       "    exec(marshal.loads(open(p, 'rb').read()[16:]))\n",
    "another_process": "import subprocess, sys\n"
                       f"exec(subprocess.run(['cat', {ORIGIN!r}], capture_output=True, text=True).stdout)\n",
    "os_system": f"import os\nos.system('cp {ORIGIN} copy.py')\nexec(open('copy.py').read())\n",
    "ctypes": "import ctypes\nlibc = ctypes.CDLL(None)\n",
    "proc_self_mem": "open('/proc/self/mem', 'rb')\n",
    "gc_graph": "import gc\ngc.get_objects()\n",
}


def embedded_routes() -> dict[str, str]:
    """Routes whose file carries the engine's code in another form (a string, marshalled bytes)."""
    code = compile(GOOD, "elsewhere.py", "exec")
    return {
        "compiles_the_source_from_a_string": f"exec(compile({GOOD!r}, 'x.py', 'exec'))\n",
        "marshalled_code": f"import marshal\nexec(marshal.loads({marshal.dumps(code)!r}))\n",
    }


def test_every_road_to_the_engines_code_ends_in_a_verdict(tmp_path):
    lab = unit_checks()
    py_compile.compile(ORIGIN, doraise=True)           # the cached bytecode a student would look for
    for name, text in {**ROUTES, **embedded_routes()}.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        rows = run_checks(lab, path, time_limit_s=20)
        if name != "delegates_to_the_engine":     # (its other bodies are the engine's module's, copied)
            assert not any(r.passed for r in rows), (name, [r.check for r in rows if r.passed])
        judged = next(r for r in rows if r.function == BLANK_BODY)
        assert PHRASE in judged.detail and "\n" not in judged.detail, (name, judged.detail)


def test_a_verbatim_copy_passes_and_is_flagged(tmp_path):
    lab = unit_checks()
    path = tmp_path / "block_pool.py"
    path.write_text(GOOD)
    assert all(r.passed for r in run_checks(lab, path, time_limit_s=20))
    assert set(identical(lab, path)) == set(lab.blanks)
    renamed = GOOD.replace("ids", "chosen")            # its locals renamed: still the engine's body
    path.write_text(renamed)
    assert BLANK_BODY in identical(lab, path)


OWN_ALLOCATE = """
import collections
import typing
from nanoserve.errors import FieldError   # (the engine's other modules are the student's to use)
wanted: typing.List[int] = []
if n < 0:
    raise ValueError(f"cannot allocate {n} blocks")
if n > len(self.free_queue):
    raise MemoryError(f"need {n} blocks, {len(self.free_queue)} free")
for _ in range(n):
    block = self.free_queue.popleft()
    block.ref_count = 1
    wanted.append(block.block_id)
return list(collections.deque(wanted))
"""


def test_a_solution_of_ones_own_is_never_flagged(tmp_path):
    lab = unit_checks()
    path = tmp_path / "block_pool.py"
    path.write_text(delegating(OWN_ALLOCATE))
    rows = run_checks(lab, path, time_limit_s=20)
    assert all(r.passed for r in rows), [(r.check, r.detail) for r in rows if not r.passed]
    assert BLANK_BODY not in identical(lab, path)


def test_the_blanked_copy_keeps_lines_and_withholds_bodies():
    source = blank_source(GOOD, [BLANK_BODY])
    assert len(source.splitlines()) == len(GOOD.splitlines())
    assert "self.free_queue.popleft()" not in source.split("def allocate", 1)[1].split("def ", 1)[0]
    assert f"the engine's own `{BLANK_BODY}` is not available here" in source
    with pytest.raises(ValueError, match="no"):
        blank_source(GOOD, ["BlockPool.nothing"])


def test_the_checker_never_hands_over_the_engines_own_of_the_class_being_written():
    """A check's objects may lead to an engine object of the class the student writes (the cow-fork lab's
    KVManager): the channel refuses a handle to it, as to a module or a function."""
    from nanoserve.block_pool import BlockPool
    from nanoserve.kv_manager import KVManager
    from nanoserve_labkit.blanks import classes
    from nanoserve_labkit.remote import Loopback, Refused

    pool = BlockPool(4, 4)
    kv = KVManager(pool, None, None, lambda e: None)
    assert Loopback().parent.encode(kv, guard=True)["T"] == "ref"      # another lab: a part it is handed
    pair = Loopback()
    pair.parent.withheld_types = classes(get_lab("cow-fork"))
    with pytest.raises(Refused):
        pair.parent.encode(kv, guard=True)
    assert pair.parent.encode(pool, guard=True)["T"] == "ref"          # the pool is still the engine's to lend
