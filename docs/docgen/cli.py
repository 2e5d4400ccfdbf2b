"""Getting started's command line transcript: `nanoserve generate` on SmolLM2, run as a user runs it.

The command comes from the page's ```console block (the `$ ` line); it runs in
a subprocess at 100 columns and the block gets what the terminal showed,
stdout and stderr together. SmolLM2 is greedy here, so the text is the same
every run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from docgen import ROOT, Result, regions

PAGE = "getting-started.md"


def run_console(body: str) -> str:
    m = re.search(r"```console\n\$ (?P<cmd>.+)\n", body)
    if not m:
        raise ValueError("a console region holds a ```console block starting with a `$ ` line")
    cmd = m["cmd"]
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONUNBUFFERED": "1"}       # stdout and stderr interleave as on a terminal
    argv = shlex.split(cmd)
    if argv[0] == "nanoserve":          # the installed script, whether or not its folder is on PATH
        argv = [sys.executable, "-m", "nanoserve.cli", *argv[1:]]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                          timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"`{cmd}` exited with {proc.returncode}:\n{proc.stdout[-2000:]}")
    return f"\n```console\n$ {cmd}\n" + "\n".join(terminal_lines(proc.stdout)) + "\n```\n"


def terminal_lines(output: str) -> list[str]:
    """What a 100-column terminal shows: a progress bar redrawn in place keeps its last state, long
    lines wrap, between words (a terminal would cut "data" into "da" / "ta"; the page is read, not
    typed). Machine-specific bits are shortened: the home folder is ~, and the converted-weights
    folder loses the GGUF file's size and time stamp from its name."""
    lines: list[str] = []
    from nanoserve.models.loader import cache_root
    output = output.replace(str(cache_root()), "~/.cache/nanoserve").replace(str(Path.home()), "~")
    output = STAMP.sub(r"\1-…", output)
    for line in output.splitlines():
        line = line.rsplit("\r", 1)[-1]
        bar = PROGRESS.match(line)
        if bar and lines and lines[-1].startswith(bar["label"] + ":"):
            lines[-1] = line
        elif line.strip():
            lines.append(line)
    return [part for line in lines for part in (textwrap.wrap(line, 100, break_on_hyphens=False) or [line])]


PROGRESS = re.compile(r"(?P<label>[^:]+): +\d+%\|")
STAMP = re.compile(r"(/gguf/[^/\s)]+?)-\d+-\d+(?=[/\s)]|$)")


def make(read) -> Result:
    from nanoserve.models.loader import resolve_model_path
    resolve_model_path("smollm2")      # convert once beforehand, so the run shows the cached path
    out = Result()
    body = regions.regions(read(PAGE))["gs.cli"]
    out.region(PAGE, "gs.cli", run_console(body))
    return out
