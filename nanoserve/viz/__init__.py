"""Views of the engine for people: rich renderings for the REPL (repl.py)."""
