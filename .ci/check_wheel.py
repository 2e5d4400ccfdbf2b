"""Check the wheel a user gets from `pip install .`: every module and data file is in it, and it runs.

    python .ci/check_wheel.py            (CI runs it; about a minute)

1. Build the wheel (`pip wheel --no-deps`, as `pip install .` does) from a copy of the files git
   tracks (commit new modules first), into a temporary folder.
2. Install it with `pip install --no-deps --target` into a clean folder.
3. From a directory outside the checkout, with only that folder in front of
   `sys.path`, import every module the source tree has (nanoserve/, and tui/ as
   nanoserve_tui) and check each one came from the install, not the checkout;
   check the TUI's stylesheet is there.
4. The wheel's metadata: the MIT license as an SPDX expression with its LICENSE file, and
   `nanoserve --version` of the install says pyproject.toml's version (the one version string).
5. Run the installed `nanoserve` console script: `record` a scenario, then
   `tui --replay` that trace on Textual's headless driver, pressing keys
   (TEXTUAL_PRESS) and saving a screenshot, which must show the steps taken.

Exits non-zero with the reason on the first failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"nanoserve": ROOT / "nanoserve", "nanoserve_labkit": ROOT / "nanoserve_labkit", "nanoserve_tui": ROOT / "tui"}   # import name -> folder
DATA_FILES = ["nanoserve_tui/app.tcss", "nanoserve_tui/replay.html", "nanoserve_tui/web.html", "nanoserve/cpu/attention.c", "nanoserve/cpu/ops.c",
              "nanoserve/cpu/matmul.c", "nanoserve/cpu/matmul_bf16.c", "nanoserve/cpu/cpu_math.h"]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) if len(str(c)) < 80 else str(c)[:60] + " …" for c in cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def source_modules() -> list[str]:
    """Every module of the source tree, by the name it has once installed."""
    names = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package, *parts)))
    return names


def copy_sources(dest: Path) -> None:
    """The files git tracks (or, outside a git checkout, the tree without build products)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info",
                                                                  "__pycache__", "site"))
        return
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


IMPORT_ALL = """
import importlib, json, sys
site, modules = sys.argv[1], json.loads(sys.argv[2])
outside = []
for name in modules:
    module = importlib.import_module(name)
    if not module.__file__.startswith(site):
        outside.append(f"{name} from {module.__file__}")
if outside:
    sys.exit("imported from outside the installed wheel: " + "; ".join(outside))
print(f"{len(modules)} modules imported from {site}")
"""


def check_metadata(site: Path, said: str) -> None:
    """License metadata and files in the install; `nanoserve --version` (`said`) is pyproject.toml's version."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    if said != f"nanoserve {version}":
        sys.exit(f"the installed `nanoserve --version` says {said!r}, pyproject.toml says {version}")
    info = next(site.glob("nanoserve-*.dist-info"))
    metadata = (info / "METADATA").read_text()
    if "License-Expression: MIT" not in metadata or "License-File: LICENSE" not in metadata:
        sys.exit("the wheel's METADATA lacks `License-Expression: MIT` or `License-File: LICENSE`")
    if not (info / "licenses" / "LICENSE").is_file():
        sys.exit("the LICENSE file is missing from the wheel's dist-info")
    print(f"metadata: {said}, License-Expression: MIT, LICENSE in {info.name}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="nanoserve-wheel-") as tmp:
        tmp = Path(tmp)
        # Build from a copy of the tracked files: a stale build/ or an untracked file of the checkout
        # must not make the wheel look complete.
        src = tmp / "src"
        copy_sources(src)
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp / "dist", src])
        wheel = next((tmp / "dist").glob("nanoserve-*.whl"))
        site = tmp / "site"
        run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel])
        for data in DATA_FILES:
            if not (site / data).is_file():
                sys.exit(f"{data} is missing from the wheel")
        # PYTHONPATH puts the install first; the editable install of the checkout (if any) comes later.
        env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        work = tmp / "work"
        work.mkdir()
        modules = source_modules()
        print(run([sys.executable, "-c", IMPORT_ALL, str(site), json.dumps(modules)], cwd=work, env=env).stdout.strip())

        script = site / "bin" / "nanoserve"
        nanoserve = [sys.executable, script]
        run([*nanoserve, "--help"], cwd=work, env=env)
        check_metadata(site, run([*nanoserve, "--version"], cwd=work, env=env).stdout.strip())
        run([*nanoserve, "record", "--scenario", "memory-pressure", "-o", "pressure.jsonl"], cwd=work, env=env)
        headless = {**env, "TEXTUAL_DRIVER": "textual.drivers.headless_driver:HeadlessDriver",
                    "TEXTUAL_PRESS": "space,space,space", "TEXTUAL_SCREENSHOT": "3",
                    "TEXTUAL_SCREENSHOT_LOCATION": str(work), "TEXTUAL_SCREENSHOT_FILENAME": "tui.svg"}
        run([*nanoserve, "tui", "--replay", "pressure.jsonl"], cwd=work, env=headless)
        svg = (work / "tui.svg").read_text()
        if "REPLAY" not in svg or "step&#160;3/" not in svg:
            sys.exit("the headless TUI's screenshot does not show a replay at step 3")
        print(f"the installed TUI replayed pressure.jsonl to step 3 ({len(svg)} bytes of screenshot)")
    print("wheel OK")


if __name__ == "__main__":
    main()
