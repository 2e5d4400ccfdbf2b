"""Regenerate every transcript, picture, fact and lesson output in the docs.

    python docs/generate.py              # run everything, rewrite what changed
    python docs/generate.py --check      # compare only; exit 1 and show diffs if the docs are stale
    python docs/generate.py home step    # only these jobs (names: --list)
    python docs/generate.py --lessons    # only the lessons' outputs (and their "break it" runs)
    python docs/generate.py --lessons 01 07   # only these lessons (by number)

Deterministic: tiny models with fixed seeds, SmolLM2 greedy, output at 100
columns. What a rerun changes without the engine changing (wall-clock times)
is masked when comparing, and a file whose comparable content is unchanged is
not rewritten. tests/test_docs.py and tests/test_lessons.py run the same
comparisons.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")     # tiny tensors: one thread is fastest, and fair to neighbours
os.environ.setdefault("TRITON_INTERPRET", "1")    # lesson 3 runs Triton on the CPU
sys.path.insert(0, str(Path(__file__).resolve().parent))

from docgen import DOCS, JOBS, ROOT, Result, read_page, regions  # noqa: E402
from docgen import lessons as lesson_runs  # noqa: E402
from docgen.pictures import same_file  # noqa: E402


def apply(result: Result, check: bool) -> list[str]:
    """Write (or, with check, compare) a job's result; returns one message per stale item."""
    stale = []
    for page, bodies in result.regions.items():
        text = read_page(page)
        old = regions.regions(text)
        changed = {name: body for name, body in bodies.items() if name not in old or regions.diff(old[name], body, name)}
        for name in changed:
            stale.append(regions.diff(old.get(name, ""), changed[name], f"{page}#{name}"))
        if changed and not check:
            (DOCS / page).write_text(regions.replace(text, changed, page))
    for path, data in result.files.items():
        target = ROOT / path
        problem = same_file(target, data)
        if problem:
            stale.append(f"{path}: {problem}")
            if not check:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", help="jobs to run (default: all)")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if anything is stale")
    parser.add_argument("--lessons", action="store_true", help="only the lessons' outputs and break-it runs")
    parser.add_argument("--no-lessons", action="store_true", help="skip the lessons")
    parser.add_argument("--list", action="store_true", help="list the jobs")
    args = parser.parse_args(argv)
    if args.list:
        for job in JOBS:
            print(f"{job.name:10s} {'(slow) ' if job.slow else ''}{job.about}")
        print(f"{'lessons':10s} lessons/*.py: outputs in docs/lessons/output/, break-it messages in the pages")
        return 0
    unknown = set(args.jobs) - {j.name for j in JOBS}
    if unknown and not args.lessons:
        parser.error(f"unknown job(s) {', '.join(sorted(unknown))}; see --list")
    jobs = [] if args.lessons else [j for j in JOBS if not args.jobs or j.name in args.jobs]
    stale = []
    for job in jobs:
        t0 = time.perf_counter()
        found = apply(job.run(read_page), args.check)
        stale += found
        print(f"{job.name}: {len(found)} stale  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if not args.check and not args.lessons and (not args.jobs or "serving" in args.jobs):
        from docgen import serving  # a live run with clients on threads: redrawn, never compared
        t0 = time.perf_counter()
        serving.attach()
        print(f"serving (tui-attach.svg, live): redrawn  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if (args.lessons or not args.jobs) and not args.no_lessons:
        chosen = [lesson for lesson in lesson_runs.LESSONS
                  if not (args.lessons and args.jobs) or lesson.name.startswith(tuple(args.jobs))]
        for lesson in chosen:
            t0 = time.perf_counter()
            found = apply(lesson_runs.make(lesson), args.check)
            stale += found
            print(f"{lesson.name}: {len(found)} stale  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        t0 = time.perf_counter()
        messages = lesson_runs.run_breaks({lesson: list(lesson_runs.declared_breaks(lesson)) for lesson in chosen})
        found = apply(lesson_runs.break_regions(messages), args.check)
        stale += found
        print(f"break-it runs: {len(found)} stale  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    for message in stale:
        print(message)
    if args.check and stale:
        print(f"{len(stale)} stale item(s): run `python docs/generate.py` to regenerate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
