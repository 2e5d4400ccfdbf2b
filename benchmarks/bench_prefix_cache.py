"""Prefix cache and copy-on-write fork: compute and memory saved, measured in one run.

    python benchmarks/bench_prefix_cache.py                     # SmolLM2-135M
    python benchmarks/bench_prefix_cache.py --model tiny-llama  # seconds, any machine

Part 1, the shared-system-prompt workload (lesson 4's, at scale): 64 requests share a
512-token system prompt and each adds a 32-token question of its own. All
arrive at once; each generates a few tokens. The same engine settings run it
with the radix prefix cache on and off, and the script prints:

* prefill tokens computed (target: on <= 15 % of off),
* mean and p50 time to first token, from arrival,
* throughput (all tokens, prompt and output, per second of wall clock) and its ratio.

Part 2, parallel sampling: one prompt with n = 8 (one prefill, eight forks
sharing its blocks) against 8 independent requests of the same prompt with
the cache off, comparing the peak number of KV blocks in use.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tqdm import tqdm

from nanoserve import EngineConfig, LLMEngine, SamplingParams
from nanoserve.models.loader import load_model


def workload(vocab: int, num_requests: int, system_len: int, question_len: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(system_len)]
    return [system + [rng.randrange(100, vocab) for _ in range(question_len)] for _ in range(num_requests)]


def run_shared(loaded, prompts, args, caching: bool) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                                    max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs,
                                    enable_prefix_caching=caching), loaded=loaded)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    prefill, ttft, outputs = 0, {}, {}
    with tqdm(total=len(prompts), desc=f"cache {'on' if caching else 'off'}", unit="req", leave=False) as bar:
        while engine.has_unfinished_requests():
            result = engine.step()
            prefill += result.stats.num_prefill_tokens
            now = time.perf_counter() - t0
            for out in result.outputs:
                ttft.setdefault(out.request_id, now)
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
                    bar.update(1)
    elapsed = time.perf_counter() - t0
    total_tokens = sum(len(p) for p in prompts) + sum(len(t) for t in outputs.values())
    return {"prefill": prefill, "ttft": list(ttft.values()), "elapsed": elapsed, "tokens": total_tokens,
            "outputs": outputs, "stats": engine.prefix_cache_stats()}


def peak_blocks(loaded, prompt, args, n: int, forked: bool) -> tuple[int, list[list[int]]]:
    """Peak KV blocks in use: one request with n forks, or n separate requests (cache off for both)."""
    engine = LLMEngine(EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                                    max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=max(n, 8),
                                    enable_prefix_caching=False), loaded=loaded)
    if forked:
        engine.add_request("p", prompt, SamplingParams(n=n, max_tokens=args.sample_tokens, seed=0, ignore_eos=True))
    else:
        for i in range(n):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=args.sample_tokens, seed=i, ignore_eos=True))
    peak, completions = 0, []
    while engine.has_unfinished_requests():
        result = engine.step()
        peak = max(peak, engine.pool.num_used_blocks)
        completions += [c.token_ids for o in result.outputs if o.finished for c in o.outputs]
    return peak, completions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request in part 1")
    ap.add_argument("--sample-tokens", type=int, default=64, help="tokens per completion in part 2")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()

    loaded = load_model(args.model)
    vocab = loaded.model.config.vocab_size
    prompts = workload(vocab, args.num_requests, args.system_len, args.question_len)
    print(f"model {args.model}; {args.num_requests} requests = {args.system_len}-token shared system prompt + "
          f"{args.question_len}-token question, {args.max_tokens} output tokens each; block_size "
          f"{args.block_size}, budget {args.max_batched_tokens} tokens/step, max_num_seqs {args.max_num_seqs}")
    off = run_shared(loaded, prompts, args, caching=False)
    on = run_shared(loaded, prompts, args, caching=True)
    assert on["outputs"] == off["outputs"], "greedy outputs differ with the cache on and off"
    print(f"{'':14}{'prefill tokens':>16}{'TTFT mean':>12}{'TTFT p50':>11}{'tokens/s':>11}")
    for name, r in (("cache off", off), ("cache on", on)):
        print(f"{name:14}{r['prefill']:>16}{statistics.mean(r['ttft']):>11.2f}s{statistics.median(r['ttft']):>10.2f}s"
              f"{r['tokens'] / r['elapsed']:>11.0f}")
    print(f"prefill computed with the cache on: {on['prefill'] / off['prefill']:.1%} of off (target <= 15 %); "
          f"hit rate {on['stats']['hit_rate']:.1%}")
    print(f"TTFT mean: {statistics.mean(off['ttft']) / statistics.mean(on['ttft']):.2f}x better; "
          f"throughput: {off['elapsed'] / on['elapsed']:.2f}x; greedy outputs identical")

    n = 8
    forked, completions = peak_blocks(loaded, prompts[0], args, n, forked=True)
    separate, _ = peak_blocks(loaded, prompts[0], args, n, forked=False)
    assert len(completions) == n
    print(f"\nparallel sampling, n = {n}, {len(prompts[0])}-token prompt, {args.sample_tokens} tokens each: "
          f"peak blocks {forked} forked vs {separate} as {n} separate requests ({forked / separate:.0%})")


if __name__ == "__main__":
    main()
