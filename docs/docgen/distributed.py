"""The distributed pictures: how one layer and one request's KV are split, and a disaggregated decode side.

* `tp-split.svg`: layer 0 of tiny-llama's weights and one request's KV over 2
  ranks, drawn by `nanoserve/viz/tp_dot.py` from the real shards and a real
  request of a tensor-parallel engine (`docs/img/make_distributed_pictures.py`
  owns the workload);
* `tui-disaggregated.svg`: the TUI replaying the decode side of a
  disaggregated run on SmolLM2 (the reading path), one step after the second
  KV handoff arrived.

The tensor-parallel TUI screenshot is the `screens` job's (the
`tensor-parallel` scenario). Both workloads start worker processes (gloo).
"""

from __future__ import annotations

import asyncio
import importlib.util
import tempfile
from pathlib import Path

from docgen import DOCS, Result
from docgen.pictures import graphviz_svg


def pictures_script():
    spec = importlib.util.spec_from_file_location("make_distributed_pictures",
                                                  DOCS / "img" / "make_distributed_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(read) -> Result:
    from docgen.screens import shoot
    from nanoserve import events as ev
    from nanoserve.trace import read_trace

    script = pictures_script()
    out = Result()
    out.files["docs/img/tp-split.svg"] = graphviz_svg(script.split_source())
    with tempfile.TemporaryDirectory() as tmp:
        trace, svg = Path(tmp) / "tui-disaggregated.jsonl", Path(tmp) / "tui-disaggregated.svg"
        # readable questions and answers ("Q: What is 2+2?" / " 4"), the same tokens on every CPU
        script.record_disaggregated(trace, "smollm2", system="Short answers only.\n\n", form="Q: {}\nA:",
                                    path="reading")
        arrived = [e.step for e in read_trace(trace) if isinstance(e, ev.KVTransferred)]
        asyncio.run(shoot(trace, arrived[1] + 1, (160, 50), svg))
        out.files["docs/img/tui-disaggregated.svg"] = svg.read_bytes()
    return out
