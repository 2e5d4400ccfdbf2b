"""The serving page's pictures: `python docs/img/make_serving_pictures.py`.

* serve-architecture.svg: the architecture of `nanoserve serve`, drawn with
  Graphviz. Every box names the code it stands for (`module:object`);
  tests/test_serve_docs.py imports each one, so the picture cannot name code
  that is gone, and checks that the SVG was drawn from this file as it is.
* tui-attach.svg: `nanoserve tui --attach` on a real server (SmolLM2, so the answers are text) while
  six "students" send requests: one is refused (429), one hangs up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).with_name("serve-architecture.svg")
ATTACH_OUT = Path(__file__).with_name("tui-attach.svg")

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
    ("admit", "admit: 429 if the waiting queue is full;\\nengine.add_request",
     "nanoserve.serve.engine_loop:EngineLoop._admit"),
    ("step", "engine.step()\\nschedule -> forward -> sample", "nanoserve.engine:LLMEngine.step"),
    ("detok", "incremental detokenizer\\n(text deltas, stop strings)", "nanoserve.detokenizer:IncrementalDetokenizer"),
    ("bus", "EventBus\\n(every decision as an event)", "nanoserve.trace:EventBus"),
    ("abort", "engine.abort_request\\n(blocks freed or cached)", "nanoserve.engine:LLMEngine.abort_request"),
]
QUEUES = [
    ("tokenize", "tokenizer threads: count the prompt,\\n400 if it does not fit the context",
     "nanoserve.serve.engine_loop:EngineLoop._prepare"),
    ("commands", "command queue\\n(queue.Queue)", "nanoserve.serve.engine_loop:EngineLoop.call"),
    ("sink", "Sink per request\\n(asyncio.Queue)", "nanoserve.serve.engine_loop:Sink"),
    ("watchers", "Watcher per /events client\\n(one batch per step)", "nanoserve.serve.event_stream:Watcher"),
]
# (from, to, label): requests flow left to right; an edge drawn as (a, b, label, "back") points
# from b to a, so that every edge ranks left to right and the columns stay apart.
EDGES = [
    ("curl", "routes", "HTTP"), ("routes", "tokenize", "submit"), ("tokenize", "commands", ""),
    ("routes", "commands", "abort"),
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


def attach_screenshot() -> str:
    """The attached TUI mid-run, as the app's own SVG screenshot."""
    import asyncio
    import threading
    import time

    import httpx

    from nanoserve import EngineConfig, LLMEngine
    from nanoserve.serve.app import build_app
    from nanoserve.serve.background import BackgroundServer
    from nanoserve_tui.attach import AttachSource
    from nanoserve_tui.attach_app import AttachApp

    engine = LLMEngine(EngineConfig(model="smollm2", block_size=4, num_blocks=48, max_num_seqs=4,
                                    max_num_batched_tokens=32))
    app = build_app(engine, max_waiting=2, step_delay=0.15)

    def student(url: str, user: str, prompt: str, hang_up: bool = False) -> None:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True, "user": user}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                for n, _ in enumerate(response.iter_lines()):
                    if hang_up and n > 30:
                        return
        except httpx.HTTPError:          # still streaming when the picture is taken and the server stops
            pass

    async def shoot(url: str) -> str:
        tui = AttachApp(AttachSource(url))
        async with tui.run_test(size=(160, 50)) as pilot:
            while tui.frame is None:
                await pilot.pause(0.05)
            for user, prompt, hang_up in [("ada", "What is a KV cache?", False), ("grace", "Why page it?", False),
                                          ("alan", "Who schedules?", True), ("edsger", "What is a block?", False),
                                          ("barbara", "Explain batching", False), ("ken", "And preemption?", False),
                                          ("eve", "Me too!", False)]:
                threading.Thread(target=student, args=(url, user, prompt, hang_up), daemon=True).start()
                await pilot.pause(0.25)
            # until alan's hang-up shows (a busy machine streams slower), at most 60 s
            for _ in range(240):
                await pilot.pause(0.25)
                svg = tui.export_screenshot(title=f"nanoserve tui --attach {url}")
                if "disconnected" in svg:
                    break
            return svg

    with BackgroundServer(app) as background:
        svg = asyncio.run(shoot(background.url))
        time.sleep(0.5)
    return svg


def main(what: str = "all") -> None:
    if what in ("all", "architecture"):
        svg = subprocess.run(["dot", "-Tsvg"], input=architecture_dot(), capture_output=True, text=True, check=True)
        OUT.write_text(svg.stdout)
        print(f"wrote {OUT}", file=sys.stderr)
    if what in ("all", "attach"):
        ATTACH_OUT.write_text(attach_screenshot())
        print(f"wrote {ATTACH_OUT}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
