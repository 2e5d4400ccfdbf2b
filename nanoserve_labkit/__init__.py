"""The grader of `nanoserve lab`: where a student's code runs, and how its checks reach it.

The labs themselves (what a student reads: each lab's text, starter rules and
checks) live in `nanoserve.labs`. This package is the machinery around them:
it imports a student's file in a sandboxed worker process, gives the checks
(which stay in the checker's process) handles to the student's objects, and
turns the checks' outcomes into a verdict, a table and a grade sheet. A
student never needs to read it; a lab author reads `mutate.py`. Modules:

    command.py    the `nanoserve lab` subcommands: list, start, check, grade
    run.py        running the checks here, the student's code in a worker, each check with a time limit
    remote.py     objects of the other process used as if they were here: the two-way channel
    codec.py      what crosses the channel and how: values copied, other objects left behind as handles
    proxy.py      the stand-in for an object of the other process (attributes and calls are requests)
    wire.py       the channel's frames (length-prefixed JSON, never a pickle) and tensor codecs
    sandbox.py    the worker's process: own session, scratch folder, guardian that kills what it started
    confine.py    what the kernel keeps the worker from: Landlock, a PID namespace, PR_SET_DUMPABLE
    grade.py      `lab grade`: each submission in its own copy, checked by its own checker process
    integrity.py  the checker's own code: the installed files against their RECORD, the import path watched
    worker.py     the worker: imports the student's file, answers the checker's requests
    blanks.py     the lab's engine module with the student's bodies withheld; copies of them, found and flagged
    guard.py      the worker's audit hook: the roads around the withheld bodies, closed while a check runs
    report.py     the results table, `lab grade`'s table and CSV
    mutate.py     mutants of a lab's solution, to test the checks (benchmarks/lab_mutation.py runs them)
    capstone.py   `nanoserve lab capstone`: the student's whole engine in the worker, judged here
    capstone_compare.py  a stage's result, reports compared, the part whose event differs
    capstone_fuzz.py     the capstone's state machine: the same random operations on both engines
"""
