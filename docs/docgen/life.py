"""Life of a request: one request through the modules, drawn from its real trace.

A small workload on tiny-llama: `warm` leaves its prompt in the prefix cache,
`other` decodes the whole time, and `life` arrives after step 2 with a prompt
that starts like `warm`'s, longer than one step's budget. Its events, sorted
by the module that decided them, become a table (modules × steps) drawn by
Graphviz, and the page's walkthrough states its numbers from the same events.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

from graphviz import Digraph

import nanoserve
from docgen import Result, regions
from docgen.home import _ranges
from docgen.pictures import graphviz_svg
from docgen.scenarios import words
from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve import events as ev

PAGE = "life-of-a-request.md"
CONFIG = dict(model="tiny-llama", block_size=4, num_blocks=32, max_num_batched_tokens=16)
WARM, LIFE = "The capital of France", "The capital of France is Paris; of Italy, Rome."

# The diagram's columns: the modules a request meets, left to right, and their files.
COLUMNS = [
    ("engine · scheduler", "engine.py, scheduler.py"),
    ("prefix cache · block pool", "radix_cache.py, block_pool.py"),
    ("runner + model", "runner.py, attention.py"),
    ("sampler · detokenizer", "sampler.py, detokenizer.py"),
]


CODE = f"""\
engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=32,
                                max_num_batched_tokens=16))
events = []
engine.subscribe(events.append)          # every event from now on (first an EngineSynced)
greedy = dict(temperature=0, ignore_eos=True)
engine.add_request("warm", {WARM!r}, SamplingParams(max_tokens=2, **greedy))
engine.add_request("other", "Hi", SamplingParams(max_tokens=12, **greedy))
engine.step()
engine.step()
engine.add_request("life", {LIFE!r}, SamplingParams(max_tokens=4, **greedy))
while engine.has_unfinished_requests():
    engine.step()
"""


def run() -> tuple[LLMEngine, list]:
    """Run CODE (the page shows it as written); the engine and every event after EngineSynced."""
    ns = {"LLMEngine": LLMEngine, "EngineConfig": EngineConfig, "SamplingParams": SamplingParams}
    exec(CODE, ns)
    assert ns["engine"].config.max_num_batched_tokens == CONFIG["max_num_batched_tokens"]
    return ns["engine"], ns["events"][1:]


# What each module does in a step, for the route (a module the step enters that is missing
# here fails the job: the page must name every module a request passes through).
ROLES = {
    "engine.py": "`step()`: the hub that calls each part below in turn and emits the events",
    "trace.py": "`EventBus`: hands each event to the subscribers",
    "step_rollback.py": "saves the sequences' RNG states, so a failed step can be undone",
    "spec_decode.py": "speculative decoding: drafts before scheduling, a `Verdict` after the forward",
    "scheduler.py": "`schedule()`: the passes that decide who runs this step and with how many tokens",
    "kv_manager.py": "the block work of that plan: prefix match, new blocks, copy-on-write, swaps",
    "sequence.py": "the sequence's token counts and status changes",
    "block_pool.py": "ref counts and the free queue",
    "kv_groups.py": "the blocks each table still needs (one KV cache group here: every block, no window)",
    "radix_cache.py": "the prefix lookup at admission; after the commit, newly full blocks join the tree",
    "prompt_logprobs.py": "more logits rows for prompt log-probabilities, when a request asks (none here)",
    "runner.py": "`prepare` and `run`: the flat row of tokens, their slots, one forward",
    "kernels/backends.py": "which attention backend runs",
    "kernels/torch_backend.py": "the torch backend's metadata: block tables and masks for the reference functions",
    "attention.py": "`paged_attention`: K/V written at their slots, attention through the block tables",
    "kernels/reference.py": "K/V stored at their slots; decode and prefill attention over gathered blocks",
    "models/llama.py": "the model: its layers, or (under cpu/llama.py) its RoPE tables",
    "cpu/backend.py": "the CPU attention backend: every row's block table and length for the C kernel",
    "cpu/attention.py": "paged attention in C (cpu/attention.c), one query per row, K/V read in place",
    "cpu/llama.py": "the same layers on a CPU: merged matmuls, the small steps in C",
    "cpu/forward.py": "every layer's C calls made from C, in one call (cpu/forward.c)",
    "cpu/ops.py": "RMSNorm with the residual add, RoPE, silu(gate) * up: one C call each (cpu/ops.c)",
    "kernels/checks.py": "each C call's arguments checked first (shape, dtype, layout)",
    "cpu/linear.py": "the linear layers' CPU path",
    "cpu/matmul.py": "the linear layers' matmul in C (cpu/matmul.c), from weights packed in 16-column panels",
    "token_choice.py": "a `Choice` per chunk that reached its sequence's end (no bookkeeping changes)",
    "sampling_params.py": "the request's sampling settings",
    "request.py": "the request the sequence belongs to (with n > 1, its forks-to-be)",
    "sampler.py": "penalties, temperature, top-k/top-p/min-p, the draw",
    "beam_search.py": "beam search: a `BeamStep` of forks, continuations and prunes",
    "commit.py": "each choice applied through the request table: tokens, forks, trims of rejected drafts, beam steps",
    "request_table.py": "the live requests; at commit `append_token` (the stop checks) and `finish`",
    "detokenizer.py": "token ids to text, holding back partial characters and stop strings",
    "outputs.py": "`RequestOutput` and the step's statistics",
}


def route(step: int, **settings) -> tuple[list[str], list[str]]:
    """The engine's modules in the order step `step` of CODE first enters them (a profile hook), and the
    C files that step runs (named by `engine.implementation`: ctypes calls are invisible to the hook)."""
    engine = LLMEngine(EngineConfig(**CONFIG, **settings))
    greedy = dict(temperature=0, ignore_eos=True)
    engine.add_request("warm", WARM, SamplingParams(max_tokens=2, **greedy))
    engine.add_request("other", "Hi", SamplingParams(max_tokens=12, **greedy))
    engine.step()
    engine.step()
    engine.add_request("life", LIFE, SamplingParams(max_tokens=4, **greedy))
    while engine.step_count < step - 1:
        engine.step()
    root, seen = Path(nanoserve.__file__).parent, []

    def entered(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(str(root)):
            module = Path(name).relative_to(root).as_posix()
            if module not in seen:
                seen.append(module)

    sys.setprofile(entered)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    missing = [m for m in seen if m not in ROLES]
    assert not missing, f"the route page has no role for {missing}: add them to ROLES"
    impl = engine.implementation
    c_files = [f for part in (impl.attention, impl.model, impl.matmul) for f in re.findall(r"cpu/\w+\.c", part)]
    if impl.model.startswith("CpuLlama"):
        c_files.append("cpu/ops.c")
    return seen, sorted(set(c_files))


def route_list(modules: list[str], c_files: list[str]) -> str:
    items = [f"{i}. `{m}`: {ROLES[m]}" for i, m in enumerate(modules, 1)]
    items += [f"{i}. `{c}`: C, called through ctypes" for i, c in enumerate(c_files, len(modules) + 1)]
    return "\n" + "\n".join(items) + "\n"


def cell(e) -> tuple[int, str]:
    """(column, text) for one event of `life`."""
    if isinstance(e, ev.RequestAdded):
        return 0, f"add_request: {e.num_prompt_tokens} tokens"
    if isinstance(e, ev.SequenceFinished):
        return 0, f"finished: {e.finish_reason}"
    if isinstance(e, ev.SequenceAdmitted):
        return 0, "admitted"
    if isinstance(e, ev.ChunkScheduled):
        kind = "prefill" if e.is_prefill else "decode"
        return 0, f"{kind} tokens {e.start}–{e.start + e.num_tokens - 1}"
    if isinstance(e, ev.PrefixMatched):
        return 1, f"hit: {e.num_hit_tokens} of {e.num_tokens} tokens"
    if isinstance(e, ev.RadixInserted):
        return 1, f"cache blocks {_ranges(list(e.block_ids))}"
    if isinstance(e, ev.BlocksAllocated):
        return 1, f"allocate {_ranges(list(e.block_ids))}"
    if isinstance(e, ev.BlocksFreed):
        return 1, f"free {len(e.block_ids)}, {len(e.released)} to free queue"
    if isinstance(e, ev.TokenSampled):
        return 3, f"token {e.token_id} → {e.text!r}" if e.text else f"token {e.token_id} → (held)"
    raise KeyError(type(e).__name__)


def diagram(events: list) -> str:
    """A table drawn by Graphviz: a row per step, a column per module, the events of `life` in the cells."""
    mine = [e for e in events if getattr(e, "seq_id", None) == "life" and not isinstance(e, ev.RadixLocked)]
    finished = {e.step: e for e in events if isinstance(e, ev.StepFinished)}
    arrival = next(e.step for e in mine if isinstance(e, ev.RequestAdded))
    rows = ["before"] + sorted({e.step for e in mine if not isinstance(e, ev.RequestAdded)})
    grid: dict[tuple[object, int], list[str]] = {}
    for e in mine:
        row = "before" if isinstance(e, ev.RequestAdded) else e.step
        column, text = cell(e)
        grid.setdefault((row, column), []).append(text)
        if isinstance(e, ev.ChunkScheduled):
            f = finished[e.step]
            grid.setdefault((row, 2), []).append(f"forward: {f.num_prefill_tokens + f.num_decode_tokens} tokens, "
                                                 f"{f.num_seqs} seqs")
    fills = ["#deebf7", "#e5f5e0", "#fde0dd", "#fff7bc"]
    head = "".join(f'<TD BGCOLOR="{fill}"><B>{name}</B><BR/><FONT POINT-SIZE="10">{files}</FONT></TD>'
                   for (name, files), fill in zip(COLUMNS, fills))
    lines = [f'<TR><TD BGCOLOR="#f0f0f0"><B>when</B></TD>{head}</TR>']
    for row in rows:
        label = f"after step {arrival}" if row == "before" else f"step {row}"
        cells = "".join(f'<TD BGCOLOR="{fill if (row, c) in grid else "#ffffff"}">'
                        f'{"<BR/>".join(html.escape(t) for t in grid.get((row, c), [])) or " "}</TD>'
                        for c, fill in enumerate(fills))
        lines.append(f'<TR><TD BGCOLOR="#f0f0f0"><B>{label}</B></TD>{cells}</TR>')
    g = Digraph("life")
    g.attr(label="request 'life': what each module did for it, step by step", labelloc="t",
           fontname="Helvetica", fontsize="15")
    g.attr("node", shape="plaintext", fontname="Helvetica", fontsize="12")
    g.node("grid", '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="6">'
           + "".join(lines) + "</TABLE>>")
    return g.source


def make(read) -> Result:
    out = Result()
    engine, events = run()
    out.files["docs/img/life-of-a-request.svg"] = graphviz_svg(diagram(events))
    mine = [e for e in events if getattr(e, "seq_id", None) == "life"]

    def first(kind):
        return next(e for e in mine if isinstance(e, kind))

    added, match = first(ev.RequestAdded), first(ev.PrefixMatched)
    chunks = [e for e in mine if isinstance(e, ev.ChunkScheduled)]
    prefill = [c for c in chunks if c.is_prefill]
    tokens = [e for e in mine if isinstance(e, ev.TokenSampled)]
    freed, done = first(ev.BlocksFreed), first(ev.SequenceFinished)
    budget = CONFIG["max_num_batched_tokens"]
    decoders = [f"`{e.seq_id}`" for e in events if isinstance(e, ev.ChunkScheduled)
                and e.step == prefill[0].step and not e.is_prefill]
    decodes_in_first = len(decoders)
    assert match.num_hit_tokens > 0 and len(prefill) >= 2, "the walkthrough tells a cache hit and a chunked prefill"
    assert prefill[0].num_tokens == budget - decodes_in_first, "the first chunk is what the decodes left"
    assert tokens[0].step == prefill[-1].step, "the first token comes with the last prefill chunk"
    assert done.finish_reason == "length" and freed.released, "the walkthrough tells a length finish"
    out.facts(PAGE, "life", {
        "arrival": added.step, "prompt": added.num_prompt_tokens, "decoders": words(decoders),
        "admit": match.step, "hit": match.num_hit_tokens, "hit_blocks": _ranges(list(match.block_ids)),
        "budget": budget, "decodes": decodes_in_first, "chunk1": prefill[0].num_tokens,
        "chunk1_end": prefill[0].start + prefill[0].num_tokens - 1, "chunks": len(prefill),
        "last_prefill": prefill[-1].step, "first_token": tokens[0].token_id,
        "decode_steps": f"{chunks[len(prefill)].step}–{chunks[-1].step}", "finish": done.step,
        "n_out": done.num_output_tokens, "freed": len(freed.block_ids), "released": len(freed.released),
        "kept": len(freed.block_ids) - len(freed.released),
    })
    out.region(PAGE, "life.code", regions.block(CODE, "python"))
    reading, _ = route(prefill[-1].step, fast_paths=False)
    default, c_files = route(prefill[-1].step)
    assert len(reading) <= 20, f"the reading path's route has {len(reading)} modules (at most 20 stay readable)"
    out.facts(PAGE, "life", {   # the route as lists of modules; never their counts or sizes (tests/test_docs.py)
        "route_step": prefill[-1].step, "fast_only": words([f"`{m}`" for m in default if m not in reading]),
    })
    out.region(PAGE, "life.route", route_list(reading, []))
    out.region(PAGE, "life.fast_route", route_list(default, c_files))
    return out
