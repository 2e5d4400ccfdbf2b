"""The checker's own code, as installed: unchanged since `pip install`, and nothing added to its import path.

A submission that could write into site-packages would change every later
check (a `.pth` file runs at every Python start; a module shadows an engine's).
Where Landlock holds (`confine.py`) the worker cannot write there at all; these
are the checks for everywhere else, and for what was done before this run:

* `changed_files()`: every file of the installed `nanoserve` wheel (the
  `nanoserve/` and `nanoserve_labkit/` packages) against the sha256 pip wrote in
  its RECORD; files added to those packages count too. An editable install
  (a checkout) has no RECORD to trust and is not checked.
* `ImportPathWatch`: the folders on the import path, listed before a file is
  graded and after; what appeared in between was written by that file's code
  (nothing else of ours writes there), is named in its verdict and removed.
  Used only where Landlock does not confine the worker's writes (where it
  does, the worker cannot write there, and whatever appears is someone
  else's).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("nanoserve", "nanoserve_labkit")


def _editable(dist: metadata.Distribution) -> bool:
    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    return bool(info.get("dir_info", {}).get("editable"))


def changed_files(dist: metadata.Distribution | None = None) -> list[str]:
    """The package files (relative paths) that differ from the wheel's RECORD, or were added; [] for an
    editable install or where nanoserve is not installed as a distribution."""
    if dist is None:
        try:
            dist = metadata.distribution("nanoserve")
        except metadata.PackageNotFoundError:
            return []
        import nanoserve
        if Path(nanoserve.__file__).resolve().parent.parent != Path(dist.locate_file("")).resolve():
            return []        # that record is of another copy than the one running (e.g. a checkout's egg-info)
    if _editable(dist) or not dist.files or dist.read_text("RECORD") is None:
        return []            # a checkout: editable, or a source tree's egg-info (no hashes to compare with)
    recorded, changed = set(), []
    for entry in dist.files:
        top = entry.parts[0] if entry.parts else ""
        if top not in PACKAGES:
            continue
        recorded.add(Path(*entry.parts))
        path = Path(dist.locate_file(entry))
        if entry.hash is None:
            continue
        try:
            digest = hashlib.new(entry.hash.mode, path.read_bytes()).digest()
        except OSError:
            changed.append(str(entry))
            continue
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != entry.hash.value:
            changed.append(str(entry))
    base = Path(dist.locate_file(""))
    for package in PACKAGES:
        for path in sorted((base / package).rglob("*")):
            rel = path.relative_to(base)
            if path.is_file() and "__pycache__" not in rel.parts and rel not in recorded:
                changed.append(f"{rel} (added)")
    return changed


def check_installed() -> None:
    """RuntimeError (one line) when the installed nanoserve was changed after it was installed."""
    changed = changed_files()
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise RuntimeError(f"the installed nanoserve differs from its wheel ({', '.join(changed[:3])}{more}): "
                           "reinstall it (pip install --force-reinstall nanoserve) before checking labs")


def import_path_dirs() -> list[str]:
    """The folders on this interpreter's import path (sys.path's existing folders, but not the current one:
    a checker started with `python -I` does not import from there)."""
    here = os.path.abspath(".")
    return [p for p in dict.fromkeys(os.path.abspath(p) for p in sys.path if p) if os.path.isdir(p) and p != here]


class ImportPathWatch:
    """What appears in the import path's folders between `__init__` and `added()`."""

    def __init__(self, dirs: list[str] | None = None) -> None:
        self.dirs = import_path_dirs() if dirs is None else dirs
        self.before = {d: self._names(d) for d in self.dirs}

    @staticmethod
    def _names(folder: str) -> set[str]:
        try:
            return set(os.listdir(folder))
        except OSError:
            return set()

    def added(self) -> list[str]:
        """The paths that appeared since the watch started."""
        return [os.path.join(d, n) for d in self.dirs for n in sorted(self._names(d) - self.before[d])]

    def remove_added(self) -> list[str]:
        """Remove what appeared (files and folders); returns their paths."""
        found = self.added()
        for path in found:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass
        return found
