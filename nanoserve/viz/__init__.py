"""Views of the engine for people. They sit above the engine: the engine never imports them.

dot_style.py the look every Graphviz picture shares (colours, fonts, DOT helpers)
repl.py      rich panels for the REPL (`print(engine)`, a StepResult, `engine.pool`) and HTML for Jupyter;
             it registers them with `nanoserve.display`, which is how the engine's objects find them
graphviz.py  DOT pictures of block tables and the pool, from a trace or a live engine (`nanoserve export`)
radix_dot.py the DOT picture of the radix prefix tree (graphviz.radix_dot)
text.py      how a token's text is shown (newlines, special tokens, control characters)
tp_dot.py    the DOT picture of tensor parallelism: how a layer's weights and a request's KV are split
"""
