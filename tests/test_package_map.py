"""The package map in nanoserve/__init__.py's docstring names every module and subpackage, and nothing else.

A student starts from that map; a module added or removed without it is a map that lies.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import nanoserve

PACKAGE = Path(nanoserve.__file__).parent


def mapped() -> list[str]:
    """Names in the map: an indented `name.py` or `name/` at the start of a line."""
    return re.findall(r"^    (\w+\.py|\w+/) ", nanoserve.__doc__, flags=re.MULTILINE)   # (__main__.py too)


def on_disk() -> set[str]:
    modules = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    packages = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return modules | packages


def test_the_map_lists_every_module_once():
    names = mapped()
    assert len(names) == len(set(names)), f"listed twice: {sorted(n for n in names if names.count(n) > 1)}"
    missing, gone = on_disk() - set(names), set(names) - on_disk()
    assert not missing, f"modules missing from the map in nanoserve/__init__.py: {sorted(missing)}"
    assert not gone, f"the map in nanoserve/__init__.py lists modules that do not exist: {sorted(gone)}"


def test_each_subpackage_maps_its_own_modules():
    """kernels/, cpu/, models/ ...: each __init__ docstring that maps its folder names every module in it."""
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        doc = (package / "__init__.py").read_text()
        listed = set(re.findall(r"^\s*([\w*]+\.(?:py|c|h))\s", doc.split('"""')[1], flags=re.MULTILINE))
        if not listed:
            continue                      # this package's docstring does not map its files
        files = {p.name for p in package.iterdir() if p.suffix in (".py", ".c", ".h") and p.name != "__init__.py"}
        covered = {f for f in files if any(fnmatch.fnmatch(f, pattern) for pattern in listed)}   # `*_lab.py` too
        unmapped = files - covered
        gone = {pattern for pattern in listed if not any(fnmatch.fnmatch(f, pattern) for f in files)}
        assert not unmapped, f"{package.name}/__init__.py does not map {sorted(unmapped)}"
        assert not gone, f"{package.name}/__init__.py maps files that do not exist: {sorted(gone)}"
