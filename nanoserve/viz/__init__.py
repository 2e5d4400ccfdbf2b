"""Views of the engine for people.

repl.py      rich panels for the REPL (`print(engine)`, a StepResult, `engine.pool`) and HTML for Jupyter
graphviz.py  DOT pictures of block tables and the pool, from a trace or a live engine (`nanoserve export`)
radix_dot.py the DOT picture of the radix prefix tree (graphviz.radix_dot)
"""
