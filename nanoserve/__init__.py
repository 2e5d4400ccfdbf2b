"""nanoserve: a small but complete LLM serving engine, built to be watched.

    from nanoserve import LLM, LLMEngine, EngineConfig, SamplingParams

`import nanoserve` never imports textual: the TUI is a separate package. It
does not import torch either until a name that needs it is used (PEP 562
module `__getattr__`), so `nanoserve --help`, error messages and replaying a
trace start in a fraction of a second.

The package, by the part of a step each module serves (a test keeps this map
equal to the files; start with engine.py's `step()`):

Requests in
    engine.py           LLMEngine: the public API, and the step: plan -> compute -> commit
    config.py           EngineConfig: every setting, validated in one place
    sampling_params.py  SamplingParams: how a request chooses its tokens and when it stops
    intake.py           add_request's arguments -> a checked request, before anything changes
    request.py          one request and the sequences it runs (n completions, beams)
    sequence.py         one stream of tokens: its KV bookkeeping and its lifecycle
    validation.py       typed checks; each failure is a FieldError naming the field
    errors.py           the errors raised on purpose (bad input vs. a failed step)
    llm.py              LLM: a list of prompts in one call, with a progress bar

Plan: who runs this step, how many tokens each, in which blocks
    scheduler.py        continuous batching, the token budget, chunked prefill, preemption
    kv_manager.py       how a sequence's blocks change: allocate, fork, copy-on-write, swap, cache
    kv_groups.py        KV cache groups: a block table per kind of attention, blocks freed as a window slides
    group_cache.py      the prefix cache across KV cache groups: the other groups' blocks kept with group 0's
    block_pool.py       physical blocks, their ref counts, the LRU free queue
    radix_cache.py      the radix-tree prefix cache over whole blocks
    spec_decode.py      speculative decoding: proposers and the exact acceptance rule

Compute: one forward pass over the step's tokens, then the token choice
    runner.py           the KV cache tensors, the flat token row and its block tables, the forward
    implementation.py   which code runs: "auto" turned into names once, built, said in one line
    cuda_graphs.py      pure-decode steps padded to batch-size buckets, replayed as CUDA graphs
    attention.py        the attention backend interface and `paged_attention`
    models/             GPT-2 and Llama reading K/V through block tables, and their loader
    kernels/            attention kernels: the torch reference, the torch and Triton backends
    cpu/                the CPU fast path: C kernels, packed weights (only implementation.py imports it)
    token_choice.py     logits -> each sequence's next token(s), changing no bookkeeping
    prompt_logprobs.py  log-probabilities of the prompt's own tokens, from the prefill's logits
    sampler.py          logits processors, then greedy or sampled tokens
    structured_output.py  structured output: each sequence's grammar (xgrammar), its token mask, its matcher
    beam_search.py      beam search's scores and decisions
    step_rollback.py    undoing a step whose compute phase failed

Commit: the chosen tokens join their sequences
    commit.py           apply each choice to the request table: accept drafts, fork n completions, beams
    request_table.py    the live requests: append a token (text, log-probs, stop conditions), fork, finish
    detokenizer.py      incremental detokenization and stop strings
    outputs.py          RequestOutput, CompletionOutput, StepResult

Watching: what the engine decided, for people
    events.py           one small frozen record per decision
    trace.py            deliver events, record and replay them as JSONL
    trace_check.py      refuse a trace whose fields or block books are wrong, before drawing it
    fold.py             events -> the view state
    fold_groups.py      the events of KV cache groups 1.. -> the view state
    view.py             the view state every viewer draws
    kv_usage.py         one definition of "used", "cached" and the hit rate for every screen
    engine_state.py     snapshot() and check_invariants()
    display.py          how engine objects show in a REPL, without importing the viewers
    viz/                Graphviz pictures, rich panels for the REPL
    scenarios.py        small workloads that make one mechanism happen
    lesson.py           the helpers the runnable lessons share (a copied lesson still runs)

Around the engine
    components.py       the engine's replaceable parts (how a lab plugs in a student's code)
    labs/               `nanoserve lab`: write a part, the real engine judges it
    whatif/             rewind, branch, compare and plot runs
    serve/              an OpenAI-compatible HTTP server, watchable live
    distributed/        tensor parallelism and prefill/decode disaggregation across processes
    threads.py          how many CPU threads torch may use
    cli.py              the `nanoserve` command line
    roofline.py         `nanoserve bench roofline`: memory bandwidth, the bytes a decode step reads, how close it comes
    engine_flags.py     a flag for every EngineConfig field, shared by every command that builds an engine
    cli_generate.py     `nanoserve generate`: structured-output flags, the loop that runs the prompts, --stats
    __main__.py         `python -m nanoserve`: the same command line
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "EngineConfig": "nanoserve.config",
    "LLMEngine": "nanoserve.engine",
    "Components": "nanoserve.components",
    "LLM": "nanoserve.llm",
    "CompletionOutput": "nanoserve.outputs",
    "RequestOutput": "nanoserve.outputs",
    "StepResult": "nanoserve.outputs",
    "SamplingParams": "nanoserve.sampling_params",
}

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "Components", "RequestOutput", "CompletionOutput", "StepResult"]


def _version() -> str:
    """The installed distribution's version: pyproject.toml's, the one version string of the project.
    A source tree that was never installed has no metadata: "0+unknown" says so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanoserve")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    """Import the module defining `name` on first use, then keep the name here (`__version__`: read
    from the installed metadata on first use)."""
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
