"""Draw the architecture of `nanoserve serve` with Graphviz: `python docs/img/make_serving_pictures.py`.

Every box names the code it stands for (`module:object`); tests/test_serve_docs.py
imports each one, so the picture cannot name code that is gone, and checks that
docs/img/serve-architecture.svg was drawn from this file as it is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).with_name("serve-architecture.svg")

# (node id, label, the code it stands for)
CLIENTS = [
    ("curl", "curl / openai client\\nPOST /v1/completions, /v1/chat/completions", None),
    ("tui", "nanoserve tui --attach URL\\n(the projector)", "nanoserve_tui.attach:AttachSource"),
]
API = [
    ("routes", "FastAPI routes: CompletionRequest / ChatRequest\\n(pydantic) -> SamplingParams, chat template;\\n"
               "bad input -> ApiError (400 / 404)", "nanoserve.serve.openai_routes:_generate"),
    ("chunks", "ChunkWriter\\ntext deltas -> SSE chunks, [DONE]", "nanoserve.serve.responses:ChunkWriter"),
    ("events", "GET /events\\nSSE, one trace line per event", "nanoserve.serve.event_stream:event_stream"),
    ("metrics", "GET /metrics\\nPrometheus text", "nanoserve.serve.metrics:ServerMetrics"),
]
LOOP = [
    ("admit", "admit: 429 if the waiting queue is full,\\n400 if it does not fit; engine.add_request",
     "nanoserve.serve.engine_loop:EngineLoop._admit"),
    ("step", "engine.step()\\nschedule -> forward -> sample", "nanoserve.engine:LLMEngine.step"),
    ("detok", "incremental detokenizer\\n(text deltas, stop strings)", "nanoserve.detokenizer:IncrementalDetokenizer"),
    ("bus", "EventBus\\n(every decision as an event)", "nanoserve.trace:EventBus"),
    ("abort", "engine.abort_request\\n(blocks freed or cached)", "nanoserve.engine:LLMEngine.abort_request"),
]
QUEUES = [
    ("commands", "command queue\\n(queue.Queue)", "nanoserve.serve.engine_loop:EngineLoop.call"),
    ("sink", "Sink per request\\n(asyncio.Queue)", "nanoserve.serve.engine_loop:Sink"),
    ("watchers", "Watcher per /events client\\n(one batch per step)", "nanoserve.serve.event_stream:Watcher"),
]
# (from, to, label): requests flow left to right; an edge drawn as (a, b, label, "back") points
# from b to a, so that every edge ranks left to right and the columns stay apart.
EDGES = [
    ("curl", "routes", "HTTP"), ("routes", "commands", "submit / abort"),
    ("commands", "admit", ""), ("commands", "abort", "client hung up"), ("admit", "step", ""),
    ("step", "detok", ""), ("sink", "detok", "RequestOutput\\n(call_soon_threadsafe)", "back"),
    ("chunks", "sink", "", "back"), ("curl", "chunks", "stream", "back"), ("step", "bus", ""), ("abort", "bus", ""),
    ("watchers", "bus", "", "back"), ("events", "watchers", "", "back"), ("tui", "events", "SSE", "back"),
    ("metrics", "step", "after each step", "back"),
]

def refs() -> list[str]:
    return [ref for _, _, ref in CLIENTS + API + LOOP + QUEUES if ref]


def architecture_dot() -> str:
    def nodes(items, style: str) -> str:
        return "\n".join(f'    {i} [label="{label}", {style}];' for i, label, _ in items)

    box = 'shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10'
    return f"""digraph serve {{
  rankdir=LR; compound=true; nodesep=0.25; ranksep=0.6;
  node [{box}, fillcolor="#ffffff"];
  edge [fontname="Helvetica", fontsize=9, color="#555555"];
  subgraph cluster_clients {{ label="clients"; style=dashed; color="#888888";
{nodes(CLIENTS, 'fillcolor="#e8f0fe"')}
  }}
  subgraph cluster_api {{ label="API server: asyncio thread (uvicorn + FastAPI)"; style=rounded; color="#4a7bd0";
{nodes(API, 'fillcolor="#eef4ff"')}
  }}
  subgraph cluster_queues {{ label="queues between the threads"; style=dotted; color="#888888";
{nodes(QUEUES, 'shape=cds, style=filled, fillcolor="#fff6d5"')}
  }}
  subgraph cluster_loop {{ label="engine loop: one thread owns the engine"; style=rounded; color="#3f9142";
{nodes(LOOP, 'fillcolor="#eaf7ea"')}
  }}
{chr(10).join(f'  {a} -> {b} [label="{e[2]}"{", dir=back" if e[3:] else ""}];' for e in EDGES for a, b in [e[:2]])}
}}
"""


def main() -> None:
    svg = subprocess.run(["dot", "-Tsvg"], input=architecture_dot(), capture_output=True, text=True, check=True)
    OUT.write_text(svg.stdout)
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
