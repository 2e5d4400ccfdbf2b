"""Mutation testing of the labs' checks: does every small bug in a student's body fail `nanoserve lab check`?

    python benchmarks/lab_mutation.py block-pool            # one lab (resumes where it stopped)
    python benchmarks/lab_mutation.py --all --jobs 2        # every lab, two mutants at a time
    python benchmarks/lab_mutation.py block-pool --list     # the mutants, without running them
    python benchmarks/lab_mutation.py --summary             # the scores from the results so far
    python benchmarks/lab_mutation.py --all --compact       # drop stale results from the files (no run going)

Each mutant (`nanoserve_labkit/mutate.py`: the engine's own module, the
reference solution, with one small change inside one body the student
writes) is written as a student file and handed to `nanoserve lab check NAME
FILE --fail-fast --json` (the command's own entry point, in this process, so
the model loads once): a failing check kills the mutant. A mutant that passes
every check survives: it needs a check that kills it, or it is equivalent
(behaviour provably unchanged) and `tests/lab_bugs/<lab>_bugs.py` lists it in
EQUIVALENT with a one-line reason.

Resumable and parallel-safe: each result is one JSON line appended to
benchmarks/results/lab_mutation/<lab>.jsonl, keyed by the mutant and stamped
with a hash of the checks' and the engine's sources (a result whose stamp is
stale is run again); a mutant being run is claimed by a file in
<lab>.claims/, so two runs of this script (or --jobs) never run the same
mutant twice. The summary (benchmarks/results/lab_mutation.json) is what the
labs page shows: score = killed / (mutants - equivalent).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")    # the triton-decode lab's engine runs Triton's interpreter

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "lab_mutation"
SUMMARY = ROOT / "benchmarks" / "results" / "lab_mutation.json"
BUGS = ROOT / "tests" / "lab_bugs"


def cpu_line() -> str:
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
                                 if f in have)
    except OSError:
        pass
    return f"CPU: {model}; vector flags: {flags or 'unknown'}; {os.cpu_count()} logical cores"


def stamp(lab) -> str:
    """A hash of what decides a mutant's fate: the lab's checks (its module, and the helpers every lab's
    checks use) and the engine's module the mutants are made from."""
    from nanoserve.labs import LAB_MODULES
    labs = Path(importlib.import_module("nanoserve.labs").__file__).parent
    files = [Path(importlib.import_module(LAB_MODULES[lab.name]).__file__), labs / "lab.py", labs / "drive.py",
             labs / "common.py", ROOT / "nanoserve_labkit" / "mutate.py", Path(importlib.import_module(lab.module).__file__)]
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def equivalents(lab_name: str) -> dict[str, str]:
    path = BUGS / f"{lab_name.replace('-', '_')}_bugs.py"
    if not path.exists():
        return {}
    if str(BUGS) not in sys.path:
        sys.path.insert(0, str(BUGS))            # the bug files import make.py beside them
    spec = importlib.util.spec_from_file_location(f"lab_bugs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(getattr(module, "EQUIVALENT", {}))


def load_results(lab_name: str, current: str) -> dict[str, dict]:
    path = RESULTS / f"{lab_name}.jsonl"
    out: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue                      # a line cut short by a run that was killed
            if row.get("stamp") == current:
                out[row["key"]] = row
    return out


def _claim(lab_name: str, key: str) -> Path | None:
    folder = RESULTS / f"{lab_name}.claims"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / hashlib.sha1(key.encode()).hexdigest()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return path
        except FileExistsError:
            try:
                owner = int(path.read_text() or 0)
                os.kill(owner, 0)             # alive: someone runs it
                return None
            except (ValueError, ProcessLookupError, PermissionError, FileNotFoundError):
                path.unlink(missing_ok=True)  # a claim left by a run that died: take it over
    return None


def run_mutant(lab_name: str, key: str, time_limit: float, current: str) -> dict | None:
    """Run one mutant through `nanoserve lab check`; append and return its result (None: claimed elsewhere)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from nanoserve.cli import main
    from nanoserve.labs import get_lab
    from nanoserve_labkit.mutate import mutants

    lab = get_lab(lab_name)
    mutant = next(m for m in mutants(lab) if m.key == key)
    claim = _claim(lab_name, key)
    if claim is None:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="nanoserve-mutant-") as tmp:
            path = Path(tmp) / lab.file_name
            path.write_text(mutant.source)
            out = io.StringIO()
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(out):
                code = main(["lab", "check", lab_name, str(path), "--fail-fast", "--json",
                             "--time-limit", str(time_limit)])
            seconds = time.perf_counter() - t0
        rows = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
        first = next((r for r in rows if r["status"] not in ("pass", "not run")), None)
        result = {"key": key, "function": mutant.function, "line": mutant.line, "kind": mutant.kind,
                  "before": mutant.before, "after": mutant.after, "stamp": current,
                  "status": "survived" if code == 0 else "killed",
                  "check": first["check"] if first else "", "detail": first["detail"][:300] if first else "",
                  "seconds": round(seconds, 2)}
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / f"{lab_name}.jsonl", "a") as f:       # one write of one line: O_APPEND keeps it whole
            f.write(json.dumps(result) + "\n")
        return result
    finally:
        claim.unlink(missing_ok=True)


def summarize(lab_names: list[str]) -> dict:
    from nanoserve.labs import get_lab
    from nanoserve_labkit.mutate import mutants

    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    for name in lab_names:
        lab = get_lab(name)
        keys = [m.key for m in mutants(lab)]
        results = load_results(name, stamp(lab))
        equal = equivalents(name)
        done = [results[k] for k in keys if k in results]
        killed = sum(r["status"] == "killed" for r in done)
        survived = [r["key"] for r in done if r["status"] == "survived" and r["key"] not in equal]
        listed = [k for k in keys if k in equal]
        counted = len(keys) - len(listed)
        summary[name] = {"mutants": len(keys), "run": len(done), "killed": killed, "equivalent": len(listed),
                         "survived": survived, "score": round(100 * killed / counted, 1) if counted else 100.0,
                         "stale_equivalents": sorted(set(equal) - set(keys))}
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    from nanoserve.labs import get_lab, lab_names
    from nanoserve_labkit.mutate import mutants

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", metavar="LAB")
    parser.add_argument("--all", action="store_true", help="every lab")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per check (default 60)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--summary", action="store_true", help="print the scores so far, run nothing")
    parser.add_argument("--compact", action="store_true",
                        help="rewrite the result files with current results only (while no run is going)")
    args = parser.parse_args(argv)
    names = lab_names() if args.all or (args.summary and not args.labs) else args.labs
    unknown = set(names) - set(lab_names())
    if unknown or not names:
        parser.error(f"name labs among {', '.join(lab_names())} (or --all)")
    print(cpu_line(), flush=True)
    if args.compact:
        for name in names:
            lab = get_lab(name)
            keys = {m.key for m in mutants(lab)}
            rows = [r for k, r in load_results(name, stamp(lab)).items() if k in keys]
            (RESULTS / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0
    if not args.list and not args.summary:
        for name in names:
            lab = get_lab(name)
            current = stamp(lab)
            todo = [m.key for m in mutants(lab) if m.key not in load_results(name, current)]
            print(f"{name}: {len(todo)} mutants to run", flush=True)
            with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                futures = [pool.submit(run_mutant, name, key, args.time_limit, current) for key in todo]
                for i, future in enumerate(futures, 1):
                    r = future.result()
                    if r is not None:
                        print(f"  [{i}/{len(todo)}] {r['status']:8s} {r['seconds']:5.1f}s {r['key'][:110]}", flush=True)
    for name in names:
        if args.list:
            for m in mutants(get_lab(name)):
                print(f"{name}  {m.key}")
            continue
    if not args.list:
        summary = summarize(names)
        for name in names:
            s = summary[name]
            print(f"{name:20s} {s['mutants']:4d} mutants, {s['run']:4d} run, {s['killed']:4d} killed, "
                  f"{s['equivalent']:3d} equivalent, {len(s['survived']):3d} surviving: score {s['score']:.1f} %")
            for key in s["survived"]:
                print(f"    survives: {key}")
            for key in s["stale_equivalents"]:
                print(f"    listed as equivalent but no longer a mutant: {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
