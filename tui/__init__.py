"""nanoserve's terminal UI (import name `nanoserve_tui`): watch a live engine or replay a trace.

Built only on events and `fold()` view states from `nanoserve.trace`, never on
engine internals, so a recorded trace replays exactly like the live run.
"""
