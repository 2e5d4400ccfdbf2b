"""What one engine step costs when every lab part lives in the lab's worker and the engine calls it over the channel.

    python benchmarks/capstone_rpc.py [--scenario continuous-batching] [--model tiny-llama]

Runs one scenario three ways and prints seconds per step and channel calls per step:
  in-process   the engine's own parts, no worker;
  proxied      the engine here, every capstone part (the engine's own modules as the student's files) a handle
               into one worker process: each call to a part crosses the channel (the way `lab check` runs);
  in-worker    the whole engine in the worker, one call for the scenario (the way `lab capstone` runs).
The capstone's design follows from the proxied row: its calls per step times the per-call cost.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> int:
    from nanoserve.labs import get_lab
    from nanoserve.labs.capstone import PARTS, components, run_scenario
    from nanoserve.models.loader import load_model
    from nanoserve_labkit.run import Session

    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="continuous-batching")
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args()
    loaded = load_model(args.model)
    rows = []
    t0 = time.perf_counter()
    ref = run_scenario(args.scenario, None, args.model, loaded)
    rows.append(("in-process", time.perf_counter() - t0, ref["steps"], 0))

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in PARTS:
            lab = get_lab(name)
            shutil.copy(importlib.import_module(lab.module).__file__, folder / lab.file_name)
        first = get_lab(PARTS[0])
        session = Session(first, folder / first.file_name)
        try:
            modules = {PARTS[0]: session.start(600)}
            for name in PARTS[1:]:
                if name == "preemption":      # (its blanks are Scheduler's: one proxied Scheduler class)
                    continue
                modules[name] = session.ep.request({"op": "load", "path": str(folder / get_lab(name).file_name)})
            calls = [0]
            send = session.ep._send
            session.ep._send = lambda m: (calls.__setitem__(0, calls[0] + 1), send(m))[1]
            t0 = time.perf_counter()
            got = run_scenario(args.scenario, components(modules), args.model, loaded)
            rows.append(("proxied", time.perf_counter() - t0, got["steps"], calls[0]))
            calls[0] = 0
            t0 = time.perf_counter()
            try:
                session.helper("nanoserve.labs.capstone:record_json_one", str(folder), args.scenario, args.model)
                rows.append(("in-worker", time.perf_counter() - t0, ref["steps"], calls[0]))
            except Exception as exc:   # noqa: BLE001 -- a worker that imports another nanoserve (no capstone)
                print(f"in-worker: not measured ({type(exc).__name__}: {exc})")
        finally:
            session.stop()
    print(f"scenario {args.scenario}, model {args.model}, {ref['steps']} steps")
    for label, seconds, steps, n in rows:
        print(f"  {label:11s} {seconds:8.2f} s  {1000 * seconds / max(steps, 1):8.1f} ms/step  "
              f"{n / max(steps, 1):8.1f} channel messages/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
