"""What if: rewind a run, branch it with other settings, compare two runs, plot one.

    from nanoserve.whatif import Run, compare
    run = Run.start(EngineConfig(model="tiny-llama", num_blocks=24)) ...
    run.rewind(5)                              # run.py: replay the command log on the same weights
    run.branch(5, preemption_mode="swap")      # ... with a setting changed
    compare(run, other)                        # compare.py: a difference table, first diverging step

Everything here sits around the engine, never inside its step: the command
log is read from the engine's events (log.py), comparisons and plots are
built from traces (metrics.py), like every other viewer.
"""

from nanoserve.whatif.compare import Comparison, compare  # (the function shadows its module's name here)
from nanoserve.whatif.log import Command, CommandKind, CommandLog
from nanoserve.whatif.run import Run

__all__ = ["Command", "CommandKind", "CommandLog", "Comparison", "Run", "compare"]
